"""Parallel layers (non-zero biases): outputs, loss and every gradient are the same bits at
TP 1, 2, 4 for both row strategies, in fp32 and bf16; megatron-core's own layers differ in
logits, loss and gradients (the negative control).  Each input row's gradient is the same
alone as in the batch, at every TP size; with 4 leaves instead of 8 (another summation
order) it differs (the control)."""
import pytest
import torch

from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks, same_bits

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
    for what in ("logits", "loss"):
        differs = [not same_bits(results[tp][(dtype, "megatron")][what], ref[what]) for tp in (2, 4)]
        assert any(differs), f"megatron-core's own layers unexpectedly gave identical {what} at TP 2/4"
    grads_differ = [n for tp in (2, 4) for n, g in ref["grads"].items()
                    if not same_bits(results[tp][(dtype, "megatron")]["grads"][n], g)]
    assert grads_differ, "megatron-core's own layers unexpectedly gave identical gradients at TP 2/4"
    # Both stacks start from the same full weights: the values agree to rounding.
    tol = 1e-4 if dtype == "torch.float32" else 0.1
    assert torch.allclose(results[4][(dtype, "megatron")]["logits"].float(), ref["logits"].float(), atol=tol)
    assert torch.allclose(results[1][(dtype, "tree")]["logits"].float(), ref["logits"].float(), atol=tol)


def test_stack_biases_are_nonzero_and_learn(results):
    grads = results[1][("torch.float32", "tree")]["grads"]
    assert grads["fc1.bias"].abs().sum() > 0 and grads["fc2.bias"].abs().sum() > 0


def test_input_gradient_rows_alone_equal_rows_in_batch_at_every_tp(results):
    ref = results[1][("rows", 8)]["batch"]
    for tp in (1, 2, 4):
        rows = results[tp][("rows", 8)]
        assert_same_bits(rows["alone"], rows["batch"], f"TP={tp}: input gradients alone vs in the batch")
        assert_same_bits(rows["batch"], ref, f"TP={tp} vs TP=1: input gradients")
        # Control: 4 leaves instead of 8 change the summation order, and the bits.
        assert_bits_differ(results[tp][("rows", 4)]["batch"], rows["batch"], f"TP={tp}: 4 vs 8 leaves")
