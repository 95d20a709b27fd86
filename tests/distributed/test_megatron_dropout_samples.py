"""megatron's training loop on a tpinv GPT model with dropout 0.1 (hidden and attention): the masks are
keyed by samples, not by calls.

* A global batch of 4 as 1 micro-batch of 4, 2 of 2 or 4 of 1, at TP 1 and 2: every sample's
  per-token losses (16 samples over 4 steps, the weights held by lr=0 so a loss is a function of the
  masks and the sample alone) have the same bits.  Control, different by construction: a row keyed
  by its index in its micro-batch repeats the first micro-batch's masks.
* Data parallelism with ``tpinv.megatron.dropout_sample_ids`` (megatron's sampler's global ids):
  TP2 x DP2 (one micro-batch of 2 per rank) trains 4 steps (lr 1e-2) to the per-token losses, grad
  norms and weight bits of TP1 x DP1 (two micro-batches of 2).  At DP=1 the ids API and the
  default count give the same run.  Control: TP2 x DP2 without the ids (each rank counts its own
  samples from 0) differs.

Across micro-batch *sizes* only the masks and the losses are equal, not the trained weights:
megatron's DDP accumulates micro-batch gradients in a chain, and one micro-batch's token sums
(tpinv's weight gradients, torch's LayerNorm and position-embedding backward in the local spec)
group the tokens differently from two halves added (docs/megatron.md, "Dropout").
"""
import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_samples  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

SPLITS = [(4, "count", 0.0), (2, "count", 0.0), (1, "count", 0.0)]
CONTROL_SPLIT = (2, "row", 0.0)
DP_IDS, DP_COUNT = (2, "ids", 1e-2), (2, "count", 1e-2)


@pytest.fixture(scope="module")
def runs():
    return {"tp1": run_ranks(megatron_samples.worker, 1, 1, SPLITS + [CONTROL_SPLIT, DP_IDS, DP_COUNT],
                             timeout=600)[0],
            "tp2": run_ranks(megatron_samples.worker, 2, 2, SPLITS, timeout=600)[0],
            "tp2xdp2": run_ranks(megatron_samples.worker, 4, 2, [DP_IDS, DP_COUNT], timeout=600)[0]}


def test_every_micro_batch_split_draws_the_same_masks_at_tp1_and_tp2(runs):
    ref, _, _, _ = runs["tp1"][SPLITS[0]]
    assert ref.shape == (megatron_samples.STEPS * megatron_samples.GLOBAL_BATCH, megatron_samples.SEQ)
    for tp in ("tp1", "tp2"):
        for run in SPLITS:
            losses, _, _, _ = runs[tp][run]
            assert_same_bits(losses, ref, f"per-token losses, micro-batches of {run[0]} at {tp}")


def test_control_rows_keyed_by_their_place_in_the_micro_batch_differ(runs):
    ref, _, _, _ = runs["tp1"][SPLITS[0]]
    losses, _, _, _ = runs["tp1"][CONTROL_SPLIT]
    assert_same_bits(losses[:2], ref[:2], "the first micro-batch (rows 0, 1 are samples 0, 1)")
    assert_bits_differ(losses[2:4], ref[2:4], "samples 2, 3 keyed as rows 0, 1 (control)")


def test_tp2_dp2_with_sample_ids_trains_like_tp1_dp1(runs):
    ref = runs["tp1"][DP_IDS]
    for name, run in (("TP1 x DP1 counting", runs["tp1"][DP_COUNT]), ("TP2 x DP2 with ids", runs["tp2xdp2"][DP_IDS])):
        megatron_samples.assert_same_run(run, ref, name)
    ref_w = ref[2]
    # the weights moved, so the comparison above compared trained weights
    _, _, start, _ = runs["tp1"][SPLITS[0]]
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert_bits_differ(ref_w[name], start[name], f"{name} after training vs held")


def test_control_tp2_dp2_without_sample_ids_differs(runs):
    ref_losses, _, ref_w, _ = runs["tp1"][DP_IDS]
    losses, _, w, _ = runs["tp2xdp2"][DP_COUNT]
    assert_same_bits(losses[:2], ref_losses[:2], "DP rank 0's first samples (counted from 0 either way)")
    assert_bits_differ(losses[2:4], ref_losses[2:4], "DP rank 1 counts samples 2, 3 as 0, 1 (control)")
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert_bits_differ(w[name], ref_w[name], f"{name} trained without sample ids at DP=2 (control)")
