"""megatron-core's own activation recompute (TransformerConfig recompute_granularity "full" with
recompute_method "uniform"/"block", and "selective") on a GPTModel built with the tpinv spec: the
losses and every parameter gradient are the bits of the run without recompute, at TP 1 and 2, and
the same at both TP sizes -- with tpinv's invariant dropout on (the GPT-2-style config, p=0.1) and
off (the Llama-style config).

Controls, different by construction: with the dropout not told about the recompute
(``/no-replay``), a recomputed dropout draws the next call's mask, so the gradients (and the next
step's loss) change.  megatron's checkpoint calls are counted (the recompute ran), and the bytes
saved for backward fall from none to selective to full.  Under megatron's 1F1B pipeline schedule
(PP=2, two micro-batches: a stage runs two checkpointed forwards before the first recompute), full
recompute with dropout 0.1 trains to the bits of PP=1 without recompute.
"""
import pytest

pytest.importorskip("megatron.core")

import megatron_pipeline  # noqa: E402
import megatron_recompute  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks  # noqa: E402

KINDS = ("gpt2", "llama")
SETTINGS = ("none", "full-uniform-1", "full-uniform-2", "full-block-1", "selective")
RUNS = [(k, s) for k in KINDS for s in SETTINGS] + [("gpt2", "full-uniform-1/no-replay")]
#: megatron checkpoint regions entered per step (2 layers): a layer group, or each layer's attention core.
PER_STEP = {"none": 0, "full-uniform-1": 2, "full-uniform-2": 1, "full-block-1": 1, "selective": 2}


@pytest.fixture(scope="module")
def results():
    return {tp: run_ranks(megatron_recompute.worker, tp, RUNS, timeout=500)[0] for tp in (1, 2)}


def _assert_same(got, ref, what):
    assert_same_bits(got[0], ref[0], f"{what}: losses")
    assert got[1].keys() == ref[1].keys() and len(ref[1]) > 10
    for name in ref[1]:
        assert_same_bits(got[1][name], ref[1][name], f"{what}: grad of {name}")


@pytest.mark.slow
def test_megatron_recompute_same_bits_and_tp_invariant(results):
    for kind in KINDS:
        ref = results[1][(kind, "none")]
        for tp in (1, 2):
            for setting in SETTINGS:
                got = results[tp][(kind, setting)]
                assert got[2] == PER_STEP[setting] * megatron_recompute.STEPS, f"{kind} {setting} TP={tp}"
                _assert_same(got, ref, f"{kind} {setting} at TP={tp} vs no recompute at TP=1")


@pytest.mark.slow
def test_control_dropout_not_replayed_under_recompute_differs(results):
    for tp in (1, 2):
        ref, got = results[tp][("gpt2", "none")], results[tp][("gpt2", "full-uniform-1/no-replay")]
        assert got[2] == PER_STEP["full-uniform-1"] * megatron_recompute.STEPS
        assert_same_bits(got[0][0], ref[0][0], "first loss (the first forward draws the same masks)")
        assert_bits_differ(got[0][1], ref[0][1], f"second loss at TP={tp} (the counters moved twice)")
        name = "decoder.layers.0.mlp.linear_fc1.weight"
        assert_bits_differ(got[1][name], ref[1][name], f"grad of {name} at TP={tp}")


@pytest.mark.slow
def test_megatron_recompute_lowers_saved_bytes(results):
    for kind in KINDS:
        saved = {s: results[1][(kind, s)][3] for s in SETTINGS}
        assert saved["full-uniform-2"] < saved["full-uniform-1"] < saved["selective"] < saved["none"], saved
        assert saved["full-uniform-1"] < saved["full-block-1"] < saved["none"], saved


@pytest.mark.slow
def test_megatron_recompute_under_the_pipeline_schedule():
    import torch

    ref_losses, ref_norms, ref_w = run_ranks(megatron_pipeline.worker, 1, 1, 1, timeout=400)[0]
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    (losses, norms, w), entered = run_ranks(megatron_recompute.pipeline_worker, 2, 1, 2, full, timeout=400)[0]
    steps, micro = megatron_pipeline.STEPS, megatron_pipeline.MICRO
    assert entered == steps * micro, f"stage 0 entered {entered} checkpoints"  # one layer per stage
    assert_same_bits(torch.stack([torch.stack(s) for s in losses]), torch.stack([torch.stack(s) for s in ref_losses]),
                     "losses of PP=2 with full recompute")
    assert norms == ref_norms, f"grad norms {norms} vs {ref_norms}"
    assert w.keys() == ref_w.keys() and len(w) > 10
    for name in ref_w:
        assert_same_bits(w[name], ref_w[name], f"{name} after PP=2 training with full recompute")
    # control: the dropout not told about the recompute draws other masks in backward
    (_, _, other_w), _ = run_ranks(megatron_recompute.pipeline_worker, 2, 1, 2, full, True, timeout=400)[0]
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert_bits_differ(other_w[name], ref_w[name], f"{name}, recompute without the dropout replay (control)")
