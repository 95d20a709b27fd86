"""megatron-core's own training loop (megatron DDP, get_megatron_optimizer with clip_grad=1.0,
get_forward_backward_func) on a tpinv model ends 4 steps with the same losses, grad norms and
weight bits at TP 1, 2 and 4 -- GPT-2-style (LayerNorm, GeLU, biases, learned positions, dropout
0.1), Llama-style (RMSNorm, SwiGLU, GQA, RoPE) and megatron's example config (hidden 12, ffn 48,
biases, dropout 0.1, ``config.tpinv_leaves = 4``), spec-built and swapped in place.  The stock
model (megatron's layers, RNG dropout and grad norm) is the control that differs."""
import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_train  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs():
    # TP=1 on four threads, TP=2 and 4 on one a rank (as torchrun starts them): the thread count
    # must not move a bit either (torch's own norms split their token sums among threads)
    return {tp: run_ranks(megatron_train.worker, tp, timeout=600, threads=4 if tp == 1 else 1)[0] for tp in (1, 2, 4)}


@pytest.mark.parametrize("kind", ["gpt2", "llama", "example"])
@pytest.mark.parametrize("variant", ["spec", "swapped"])
def test_megatron_training_same_bits_at_every_tp(runs, kind, variant):
    ref_losses, ref_norms, ref_w = runs[1][(kind, variant)]
    for tp in (2, 4):
        losses, norms, w = runs[tp][(kind, variant)]
        assert_same_bits(torch.stack(losses), torch.stack(ref_losses), f"{kind}/{variant} losses at TP={tp}")
        assert norms == ref_norms, f"{kind}/{variant} grad norms at TP={tp}: {norms} vs {ref_norms}"
        assert w.keys() == ref_w.keys()
        for name in ref_w:
            assert_same_bits(w[name], ref_w[name], f"{kind}/{variant} {name} after 4 steps at TP={tp}")


@pytest.mark.parametrize("kind", ["gpt2", "llama", "example"])
def test_spec_and_swapped_train_alike(runs, kind):
    _, _, spec_w = runs[1][(kind, "spec")]
    _, _, swap_w = runs[1][(kind, "swapped")]
    for name in spec_w:
        assert_same_bits(spec_w[name], swap_w[name], f"{kind} {name}: spec vs swapped")


@pytest.mark.parametrize("kind", ["gpt2", "llama", "example"])
def test_stock_megatron_training_differs_across_tp(runs, kind):
    # the control: megatron's layers (plain all-reduce), its RNG dropout and its grad norm
    _, _, ref_w = runs[1][(kind, "stock")]
    _, _, w = runs[2][(kind, "stock")]
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    assert_bits_differ(w[name], ref_w[name], f"stock {kind} {name} at TP=2 vs TP=1")
