"""Queries and keys normed per head and rotated as one autograd node (``norm_and_rope``): the bits of the
separate calls.

Byte-level checks (``assert_same_bits``): a whole training step of Qwen3 models (q/k norms) with the
node against the step with the separate calls (forced by a no-op hook on a norm module, which the
node must respect), and the outputs and gradients of Llama's rope-only case against the separate
``apply_rope`` calls; control: the two norms' weights exchanged (they differ by construction)
changes the bits.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.layers import HeadRMSNorm, norm_and_rope
from tpinv.layers.query_key import grouped_norm_rope_calls
from tpinv.models import get_config
from tpinv.ops import apply_rope, rope_cos_sin
from tpinv.testing import assert_bits_differ, assert_same_bits

from model_steps import random_model, step_tensors


def _step(name: str, dtype: torch.dtype, one_by_one: bool):
    model = random_model(name, dtype)
    calls = []
    if one_by_one:
        for layer in model.layers:
            layer.self_attn.q_norm.register_forward_hook(lambda *a: calls.append(1))
    before = grouped_norm_rope_calls()
    tensors = step_tensors(model)
    return tensors, grouped_norm_rope_calls() - before, len(calls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-kv2-tiny"])
def test_grouped_step_has_the_bits_of_the_separate_calls(name, dtype):
    grouped, ran, _ = _step(name, dtype, False)
    layers = get_config(name).num_layers
    assert ran == layers
    separate, ran_alone, hook_calls = _step(name, dtype, True)
    assert ran_alone == 0 and hook_calls == layers
    for i, (a, b) in enumerate(zip(grouped, separate)):
        assert_same_bits(a, b, f"tensor {i}")


def _inputs(dtype=torch.bfloat16, heads=(4, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 5, heads[0], 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 5, heads[1], 16, generator=g).to(dtype).requires_grad_()
    cos, sin = rope_cos_sin(torch.arange(5)[None].expand(2, 5), 16, 10000.0)
    dq = torch.randn(2, heads[0], 5, 16, generator=g).to(dtype)
    dk = torch.randn(2, heads[1], 5, 16, generator=g).to(dtype)
    return q, k, cos, sin, dq, dk


def _run(fn, q, k, dq, dk):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    out_q, out_k = fn(q, k)
    torch.autograd.backward((out_q, out_k), (dq, dk))
    return out_q, out_k, q.grad, k.grad


def test_rope_alone_has_the_bits_of_the_separate_calls():
    q, k, cos, sin, dq, dk = _inputs()
    before = grouped_norm_rope_calls()
    grouped = _run(lambda a, b: norm_and_rope(a, b, cos, sin), q, k, dq, dk)
    assert grouped_norm_rope_calls() - before == 1
    separate = _run(lambda a, b: (apply_rope(a.transpose(1, 2), cos, sin), apply_rope(b.transpose(1, 2), cos, sin)),
                    q, k, dq, dk)
    for name, a, b in zip(("q", "k", "dq", "dk"), grouped, separate):
        assert_same_bits(a, b, name)


def test_each_norm_keeps_its_own_weight():
    q, k, cos, sin, dq, dk = _inputs(heads=(4, 4))
    norms = [HeadRMSNorm(16, 1e-6, torch.bfloat16, None) for _ in range(2)]
    with torch.no_grad():
        norms[0].weight.copy_(torch.linspace(0.5, 1.5, 16))
        norms[1].weight.copy_(torch.linspace(1.5, 0.5, 16))
    grouped = _run(lambda a, b: norm_and_rope(a, b, cos, sin, *norms), q, k, dq, dk)
    separate = _run(lambda a, b: (apply_rope(norms[0](a).transpose(1, 2), cos, sin),
                                  apply_rope(norms[1](b).transpose(1, 2), cos, sin)), q, k, dq, dk)
    for name, a, b in zip(("q", "k", "dq", "dk"), grouped, separate):
        assert_same_bits(a, b, name)
    exchanged = _run(lambda a, b: norm_and_rope(a, b, cos, sin, norms[1], norms[0]), q, k, dq, dk)
    assert_bits_differ(exchanged[0], grouped[0], "q normed by k's weight")
    before = grouped_norm_rope_calls()           # a forward replaced on a norm runs
    norms[0].forward = lambda x: torch.zeros_like(x)
    assert norm_and_rope(q, k, cos, sin, *norms)[0].eq(0).all() and grouped_norm_rope_calls() == before
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        norm_and_rope(q, k, cos, sin, norms[0], None)
