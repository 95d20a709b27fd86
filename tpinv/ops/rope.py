"""``tpinv::apply_rope`` and the rotary tables: one computation per position.

``rope_cos_sin`` builds fp32 ``cos``/``sin`` tables whose row for position ``p`` has the same
bits however many positions are computed with it; ``apply_rope`` rotates ``x [B, H, S, D]``
by them in fp32 from separate elementwise ops, rounded once (see
:mod:`tpinv.kernels.reference_rope`).  The CPU kernel is registered here; on CUDA the same
fixed-order code runs (:mod:`tpinv.ops.cuda_torch`).  The tables receive no gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tpinv.kernels import reference_rope
from tpinv.kernels.reference_rope import rope_cos_sin, rope_inv_freq
from tpinv.ops.registry import define_op

__all__ = ["apply_rope", "apply_rope_op", "apply_rope_backward_op", "rope_cos_sin", "rope_inv_freq"]


@define_op("apply_rope")
def apply_rope_op(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return reference_rope.apply_rope_forward(x, cos, sin)


@define_op("apply_rope_backward")
def apply_rope_backward_op(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return reference_rope.apply_rope_backward(grad, cos, sin)


@apply_rope_op.register_fake
def _apply_rope_fake(x, cos, sin):
    reference_rope.check_rope_inputs(x, cos, sin)
    return torch.empty_like(x)


@apply_rope_backward_op.register_fake
def _apply_rope_backward_fake(grad, cos, sin):
    reference_rope.check_rope_inputs(grad, cos, sin)
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
    reference_rope.check_rope_inputs(x, cos, sin)
    return apply_rope_op(x, cos, sin)
