"""Outputs come back in the layout the ops' fake kernels declare (``torch.empty_like`` of the input).

The model feeds ``q``/``k``/``v`` as ``[B, S, H, D]`` buffers viewed as ``[B, H, S, D]``; rope,
attention and their backwards return that layout (so the transposes back are views, and a
graph traced with fake tensors sees the strides eager code gets) with the values a contiguous
input gives, byte for byte.  Control: a contiguous input keeps its contiguous strides, which
differ from the transposed buffer's.  Runs on CPU here; tests/gpu/test_output_layouts_cuda.py
runs the same checks on CUDA.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.ops.attention import attention_backward_op, attention_op
from tpinv.ops.attention_packed import attention_packed_backward_op, attention_packed_op
from tpinv.ops.rope import apply_rope_backward_op, apply_rope_op, rope_cos_sin
from tpinv.testing import assert_same_bits

B, S, HQ, HKV, D = 2, 40, 4, 2, 64


def _bshd(heads: int, device: str, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """A ``[B, S, heads, D]`` buffer viewed as ``[B, heads, S, D]``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, heads, D, generator=gen).to(dtype).to(device).transpose(1, 2)


def _assert_layout(out: torch.Tensor, like: torch.Tensor, name: str) -> None:
    want = torch.empty_like(like).stride()
    assert out.stride() == want, f"{name}: strides {out.stride()}, the fake declares {want}"


def check_rope(device: str) -> None:
    x = _bshd(HQ, device, 0)
    pos = torch.arange(S, device=device).expand(B, S)
    cos, sin = rope_cos_sin(pos, D, 10000.0)
    out = apply_rope_op(x, cos, sin)
    _assert_layout(out, x, "rope")
    assert_same_bits(out, apply_rope_op(x.contiguous(), cos, sin), "rope: values of a contiguous input")
    grad = apply_rope_backward_op(out, cos, sin)
    _assert_layout(grad, out, "rope backward")
    assert_same_bits(grad, apply_rope_backward_op(out.contiguous(), cos, sin), "rope backward values")
    assert apply_rope_op(x.contiguous(), cos, sin).stride() != out.stride(), "control: contiguous stays contiguous"


def check_attention(device: str, packed: bool) -> None:
    q, k, v = _bshd(HQ, device, 1), _bshd(HKV, device, 2), _bshd(HKV, device, 3)
    pos = torch.arange(S, device=device).expand(B, S).contiguous()
    scale = D ** -0.5
    if packed:
        fwd = lambda q, k, v: attention_packed_op(q, k, v, pos, pos, None, True, None, scale)  # noqa: E731
        bwd = lambda g, q, k, v, o, l: attention_packed_backward_op(g, None, q, k, v, o, l, pos, pos, None,  # noqa: E731
                                                                    True, None, scale)
    else:
        fwd = lambda q, k, v: attention_op(q, k, v, pos, None, True, None, scale)  # noqa: E731
        bwd = lambda g, q, k, v, o, l: attention_backward_op(g, None, q, k, v, o, l, pos, None, True,  # noqa: E731
                                                             None, scale)
    out, lse = fwd(q, k, v)
    _assert_layout(out, q, "attention out")
    out_c, lse_c = fwd(q.contiguous(), k.contiguous(), v.contiguous())
    assert_same_bits(out, out_c, "attention: values of contiguous inputs")
    assert_same_bits(lse, lse_c, "attention lse")
    g = _bshd(HQ, device, 4)
    grads = bwd(g, q, k, v, out, lse)
    for name, got, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        _assert_layout(got, like, name)
    grads_c = bwd(g.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out_c, lse_c)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_c):
        assert_same_bits(got, want, f"{name}: values of contiguous inputs")
    assert out_c.stride() != out.stride(), "control: contiguous inputs give contiguous outputs"


@pytest.mark.parametrize("packed", [False, True])
def test_attention_outputs_in_the_inputs_layout(packed):
    check_attention("cpu", packed)


def test_rope_outputs_in_the_inputs_layout():
    check_rope("cpu")


@pytest.mark.parametrize("make", [
    lambda: torch.empty(2, 5, 4, 8).transpose(1, 2),     # the model's [B, S, H, D] seen as [B, H, S, D]
    lambda: torch.empty(2, 5, 4, 8),
    lambda: torch.empty(2, 1, 4, 8).transpose(1, 2),     # a size-1 dim's stride kept as empty_like keeps it
    lambda: torch.empty(0, 4, 8),
    lambda: torch.empty(3, 4)[:, :2],                    # not dense: contiguous
    lambda: torch.empty(1, 1, 1, 8).expand(2, 3, 4, 8),  # overlapping: contiguous
])
def test_layout_strides_are_empty_likes_where_the_last_stride_is_one(make):
    from tpinv.kernels.layout import empty_in_layout_of, layout_strides
    t = make()
    assert layout_strides(t) == torch.empty_like(t).stride()
    assert empty_in_layout_of(t).stride() == layout_strides(t)


def test_layout_strides_control_a_non_unit_last_stride_is_made_contiguous():
    from tpinv.kernels.layout import layout_strides
    t = torch.empty(4, 8).t()
    assert torch.empty_like(t).stride() == (1, 8) and layout_strides(t) == (4, 1)
