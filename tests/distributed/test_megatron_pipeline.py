"""megatron's pipeline schedule with tpinv layers: PP=2 x TP=2 trains (3 steps of 2 micro-batches,
megatron DDP and optimizer, clip_grad=1.0, dropout 0.1) to the same losses, grad norms and weight
bits as PP=1 x TP=1; the control changes the dropout masks (another seed) and differs.  With the rows
named by ``tpinv.megatron.dropout_sample_ids`` on every stage, PP=2 trains to the same bits."""
import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_pipeline  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow


def test_pp2_tp2_equals_pp1_tp1():
    ref_losses, ref_norms, ref_w = run_ranks(megatron_pipeline.worker, 1, 1, 1, timeout=400)[0]
    losses, norms, w = run_ranks(megatron_pipeline.worker, 4, 2, 2, timeout=400)[0]
    assert_same_bits(torch.stack([torch.stack(s) for s in losses]), torch.stack([torch.stack(s) for s in ref_losses]),
                     "losses of PP=2 x TP=2")
    assert norms == ref_norms, f"grad norms {norms} vs {ref_norms}"
    assert w.keys() == ref_w.keys() and len(w) > 10
    for name in ref_w:
        assert_same_bits(w[name], ref_w[name], f"{name} after PP=2 x TP=2 training")
    # control: other dropout masks (another seed) change the weights, so the check above would see them
    _, _, other_w = run_ranks(megatron_pipeline.worker, 1, 1, 1, 8, timeout=400)[0]
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    assert_bits_differ(other_w[name], ref_w[name], f"{name} with another dropout seed (control)")


def test_pp2_with_sample_ids_on_every_stage_equals_pp1():
    ref_losses, ref_norms, ref_w = run_ranks(megatron_pipeline.worker, 1, 1, 1, timeout=400)[0]
    losses, norms, w = run_ranks(megatron_pipeline.worker, 2, 1, 2, 7, None, True, timeout=400)[0]
    assert_same_bits(torch.stack([torch.stack(s) for s in losses]), torch.stack([torch.stack(s) for s in ref_losses]),
                     "losses of PP=2 with sample ids")
    assert norms == ref_norms, f"grad norms {norms} vs {ref_norms}"
    for name in ref_w:
        assert_same_bits(w[name], ref_w[name], f"{name} after PP=2 training with sample ids")
