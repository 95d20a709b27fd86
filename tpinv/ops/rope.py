"""``tpinv::apply_rope`` and the rotary tables: one computation per position.

``rope_cos_sin`` builds fp32 ``cos``/``sin`` tables whose row for position ``p`` has the same
bits however many positions are computed with it; ``apply_rope`` rotates ``x [B, H, S, D]``
by them in fp32 from separate elementwise ops, rounded once (see
:mod:`tpinv.kernels.reference_rope`).  On CUDA the Triton kernels of
:mod:`tpinv.kernels.triton_elementwise` run (named in the op definitions below).  The tables receive no gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tpinv.kernels import reference_rope
from tpinv.kernels.reference_rope import rope_cos_sin, rope_inv_freq
from tpinv.ops.registry import define_op, register_fake

__all__ = ["apply_rope", "apply_rope_op", "apply_rope_backward_op", "rope_cos_sin", "rope_inv_freq"]


def _check_apply_rope(x, cos, sin) -> None:
    reference_rope.check_rope_inputs(x, cos, sin)


@define_op("apply_rope", cuda="triton_elementwise.apply_rope_forward_cuda", check=_check_apply_rope)
def apply_rope_op(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return reference_rope.apply_rope_forward(x, cos, sin)


@define_op("apply_rope_backward", cuda="triton_elementwise.apply_rope_backward_cuda",
           check=_check_apply_rope)
def apply_rope_backward_op(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return reference_rope.apply_rope_backward(grad, cos, sin)


@register_fake(apply_rope_op)
def _apply_rope_fake(x, cos, sin):
    return torch.empty_like(x)


@register_fake(apply_rope_backward_op)
def _apply_rope_backward_fake(grad, cos, sin):
    return torch.empty_like(grad)


def _setup_context(ctx, inputs, output):
    x, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.x_dtype = x.dtype


def _backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return apply_rope_backward_op(grad.to(ctx.x_dtype), cos, sin), None, None


apply_rope_op.register_autograd(_backward, setup_context=_setup_context)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, H, S, D]`` by fp32 tables ``cos``/``sin`` of shape ``[B, S, D]`` or ``[S, D]``.

    ``out = x*cos + rotate_half(x)*sin`` (HF convention) in fp32, rounded once to ``x.dtype``.
    """
    return apply_rope_op(x, cos, sin)
