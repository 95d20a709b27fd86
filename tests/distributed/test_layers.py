"""Parallel layers: outputs, loss and every gradient are the same bits at TP 1, 2, 4 for both
row strategies, in fp32 and bf16; megatron-core's own layers differ (the negative control)."""
import pytest
import torch

from tpinv.testing import assert_same_bits, run_ranks, same_bits

import layer_stack

HAVE_MEGATRON = True
try:
    import megatron.core  # noqa: F401
except Exception:  # pragma: no cover
    HAVE_MEGATRON = False


@pytest.fixture(scope="module")
def results():
    return {tp: run_ranks(layer_stack.worker, tp, HAVE_MEGATRON, timeout=240)[0] for tp in (1, 2, 4)}


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
@pytest.mark.parametrize("strategy", ["tree", "column_only"])
def test_stack_same_bits_at_every_tp(results, dtype, strategy):
    ref = results[1][(dtype, "tree")]
    for tp in (1, 2, 4):
        got = results[tp][(dtype, strategy)]
        assert_same_bits(got["logits"], ref["logits"], f"logits differ at TP={tp}")
        assert_same_bits(got["loss"], ref["loss"], f"loss differs at TP={tp}")
        assert got["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            assert got["grads"][name].shape == g.shape, name
            assert_same_bits(got["grads"][name], g, f"grad {name} differs at TP={tp} ({strategy})")


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not installed")
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_megatron_layers_differ_across_tp(results, dtype):
    ref = results[1][(dtype, "megatron")]
    differs = [not same_bits(results[tp][(dtype, "megatron")]["logits"], ref["logits"]) for tp in (2, 4)]
    assert any(differs), "megatron-core's own layers unexpectedly gave identical logits at TP 2/4"
    # Both stacks start from the same full weights: the values agree to rounding.
    tol = 1e-4 if dtype == "torch.float32" else 0.1
    assert torch.allclose(results[4][(dtype, "megatron")]["logits"].float(), ref["logits"].float(), atol=tol)
    assert torch.allclose(results[1][(dtype, "tree")]["logits"].float(), ref["logits"].float(), atol=tol)
