"""The decoder at TP 1, 2 and 4 (spawned gloo ranks): the same bits everywhere.

For every family, fp32 and bf16, and both row-parallel strategies, built from the same seed:
the gathered logits, the per-token loss and every parameter gradient (gathered to the full
tensor) are bitwise equal to the TP=1 run.  Negative control: the same weights in a plain
torch model whose row-parallel K-split partial sums are added in rank order (a plain
all-reduce) give different logits, loss (taken in float64 from those logits, so that no moved
logit rounds away) and gradients at TP 2 and 4 than at TP 1.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpinv.layers import vocab_parallel_cross_entropy
from tpinv.models import Transformer, get_config
from tpinv.ops import rope_cos_sin
from tpinv.distributed.reduce import all_gather
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks

COMBOS = list(itertools.product(("qwen3-tiny", "llama-tiny", "mistral-tiny"),
                                (torch.float32, torch.bfloat16), ("tree", "column_only")))
B, S = 2, 7  # 7 > mistral-tiny's window of 5


def inputs():
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 256, (B, S), generator=gen)
    targets = torch.randint(0, 256, (B, S), generator=gen)
    weights = torch.rand(B, S, generator=gen)  # d(loss) per token: a fixed, non-uniform seed gradient
    return tokens, targets, weights


def build(name, dtype, strategy, group) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(get_config(name, dtype=dtype), tp_group=group, row_strategy=strategy)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):  # replicated: the same draw on every rank
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("proj.weight") or pname.endswith("embed_tokens.weight"):
                p.mul_(5.0)
    return model


def full_tensor(t: torch.Tensor, p: torch.nn.Parameter, group) -> torch.Tensor:
    if group is None or not getattr(p, "tensor_model_parallel", False):
        return t.detach().clone()
    return all_gather(t.detach().contiguous(), group, dim=p.partition_dim)


def run_model(rank, world_size, combos, tokens, targets, weights):
    group = dist.group.WORLD if world_size > 1 else None
    results = []
    for i, (name, dtype, strategy) in enumerate(combos):
        model = build(name, dtype, strategy, group)
        if i == 0:  # the public entry points once; one forward per model after that (time)
            logits = model(tokens, gather_logits=True).detach()
            loss = model.loss(tokens, targets)
        else:
            local = model(tokens)
            logits = local.detach() if group is None else all_gather(local.detach(), group, dim=-1)
            loss = vocab_parallel_cross_entropy(local, targets, tp_group=group, leaves=model.leaves)
        loss.backward(weights)
        grads = {n: full_tensor(p.grad, p, group) for n, p in model.named_parameters()}
        results.append({"logits": logits, "loss": loss.detach(), "grads": grads})
    return results


def assert_same(result, expected, where):
    assert_same_bits(result["logits"], expected["logits"], f"{where}: logits")
    assert_same_bits(result["loss"], expected["loss"], f"{where}: loss")
    assert result["grads"].keys() == expected["grads"].keys()
    for n, g in expected["grads"].items():
        assert result["grads"][n].shape == g.shape, f"{where}: grad shape of {n}"
        assert_same_bits(result["grads"][n], g, f"{where}: grad of {n}")


@pytest.fixture(scope="module")
def tp1():
    tokens, targets, weights = inputs()
    return run_model(0, 1, COMBOS, tokens, targets, weights)


@pytest.mark.parametrize("tp", (2, 4))
def test_logits_loss_grads_equal_across_tp(tp, tp1):
    tokens, targets, weights = inputs()
    ranks = run_ranks(run_model, tp, COMBOS, tokens, targets, weights, timeout=240)
    for rank, per_rank in enumerate(ranks):
        for combo, result, expected in zip(COMBOS, per_rank, tp1):
            assert_same(result, expected, f"TP={tp} rank {rank} {combo[0]} {combo[1]} {combo[2]}")


def test_strategies_agree_with_each_other(tp1):
    """``tree`` and ``column_only`` at TP=1 (TP 2 and 4 are compared above); the control is
    :func:`test_vanilla_tp_differs` (a full-K N-slice and a K-split sum differ in plain torch)."""
    for i in range(0, len(COMBOS), 2):
        assert COMBOS[i][2] == "tree" and COMBOS[i + 1][2] == "column_only"
        assert_same(tp1[i + 1], tp1[i], f"{COMBOS[i][:2]} column_only vs tree")


# ---------------------------------------------------------------- negative control
def row_linear(x, w, tp):
    """A plain row-parallel linear: per-rank K-slice matmuls summed in rank order."""
    k = w.shape[1] // tp
    out = F.linear(x[..., :k], w[:, :k])
    for r in range(1, tp):
        out = out + F.linear(x[..., r * k:(r + 1) * k], w[:, r * k:(r + 1) * k])
    return out


def rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos[:, None] + rot.float() * sin[:, None]).to(x.dtype)


def vanilla_logits(model: Transformer, tokens, tp: int, sd=None):
    a, sd = model.args, (model.state_dict() if sd is None else sd)
    pos = torch.arange(S).expand(B, S)
    cos, sin = rope_cos_sin(pos, a.head_dim, a.rope_theta, a.rope_scaling)
    h = sd["embed_tokens.weight"][tokens]
    for i in range(a.num_layers):
        p = f"layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"], a.rms_norm_eps)
        q, k, v = (F.linear(x, sd[p + f"self_attn.{n}_proj.weight"]).view(B, S, -1, a.head_dim) for n in "qkv")
        if a.qk_norm:
            q = rms(q, sd[p + "self_attn.q_norm.weight"], a.rms_norm_eps)
            k = rms(k, sd[p + "self_attn.k_norm.weight"], a.rms_norm_eps)
        q, k, v = rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)
        kpos = torch.arange(S)
        vis = (kpos[None] <= kpos[:, None]) & (kpos[None] > kpos[:, None] - (a.sliding_window or S + 1))
        g = a.num_heads // a.num_kv_heads
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=vis)
        h = h + row_linear(o.transpose(1, 2).reshape(B, S, -1), sd[p + "self_attn.o_proj.weight"], tp)
        x = rms(h, sd[p + "post_attention_layernorm.weight"], a.rms_norm_eps)
        act = F.silu(F.linear(x, sd[p + "mlp.gate_proj.weight"])) * F.linear(x, sd[p + "mlp.up_proj.weight"])
        h = h + row_linear(act, sd[p + "mlp.down_proj.weight"], tp)
    h = rms(h, sd["norm.weight"], a.rms_norm_eps)
    return F.linear(h, sd["embed_tokens.weight" if a.tie_word_embeddings else "lm_head.weight"])


def vanilla_run(model: Transformer, tp: int) -> dict:
    """Logits, per-token loss and gradients of the plain model, row-parallel sums over ``tp`` slices."""
    tokens, targets, weights = inputs()
    sd = {n: t.detach().clone().requires_grad_() for n, t in model.state_dict().items()}
    logits = vanilla_logits(model, tokens, tp, sd)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(B, S)
    loss.backward(weights)
    # The control's loss in float64, where a logit that moved by one fp32 ulp moves its token's loss:
    # in fp32 a 256-way log-sum-exp can round such a move away (seen at TP=4 under the AVX2 kernels).
    loss64 = F.cross_entropy(logits.detach().double().flatten(0, 1), targets.flatten(), reduction="none")
    return {"logits": logits.detach(), "loss": loss64.view(B, S), "grads": {n: t.grad for n, t in sd.items()}}


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", ("qwen3-tiny", "llama-tiny", "mistral-tiny"))
def test_vanilla_tp_differs(name, dtype):
    model = build(name, dtype, "tree", None)
    base = vanilla_run(model, 1)
    for tp in (2, 4):
        got = vanilla_run(model, tp)
        assert_bits_differ(got["logits"], base["logits"], f"vanilla TP={tp} vs TP=1 logits")
        assert_bits_differ(got["loss"], base["loss"], f"vanilla TP={tp} vs TP=1 loss")
        # The final norm's weight sees every hidden state behind the row-parallel sums.
        assert_bits_differ(got["grads"]["norm.weight"], base["grads"]["norm.weight"],
                           f"vanilla TP={tp} vs TP=1 gradient of norm.weight")
