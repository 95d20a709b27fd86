"""``tpinv::apply_rope`` and the rotary tables: one computation per position.

``rope_cos_sin`` builds fp32 ``cos``/``sin`` tables whose row for position ``p`` has the same
bits however many positions are computed with it; ``apply_rope`` rotates ``x [B, H, S, D]``
by them in fp32 from separate elementwise ops, rounded once (see
:mod:`tpinv.kernels.reference_rope`).  The tables are an op too (``tpinv::rope_cos_sin``), so
torch.compile runs their ``cos``/``sin`` as the eager kernel does instead of generating its own.  On CUDA the Triton kernels of
:mod:`tpinv.kernels.triton_elementwise` run (named in the op definitions below).  The tables receive no gradient.
"""
from __future__ import annotations

import ast
from typing import Optional

import torch
from torch import Tensor

from tpinv.kernels import reference_rope
from tpinv.kernels.reference_rope import rope_inv_freq
from tpinv.ops.registry import REFERENCE, define_op, register_fake

__all__ = ["apply_rope", "apply_rope_op", "apply_rope_backward_op", "apply_rope_input_grad", "rope_cos_sin",
           "rope_cos_sin_op", "rope_inv_freq"]


def _encode_scaling(scaling: Optional[dict]) -> Optional[str]:
    """The rope-scaling dict as the op's string argument: the ``repr`` of its sorted items (torch.compile
    traces this; it cannot trace ``json``)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"rope scaling must be a dict (HF rope_scaling) or None, got {type(scaling).__name__}")
    return repr(sorted(scaling.items()))


def _decode_scaling(scaling: Optional[str]) -> Optional[dict]:
    return None if scaling is None else dict(ast.literal_eval(scaling))


def _check_rope_cos_sin(positions, head_dim, theta, scaling) -> None:
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point \
            or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError("rope positions must be an integer tensor (e.g. int64 position ids), got "
                        f"{getattr(positions, 'dtype', type(positions).__name__)}")
    rope_inv_freq(head_dim, theta, _decode_scaling(scaling))   # head_dim, theta and scaling


@define_op("rope_cos_sin", cuda=REFERENCE, check=_check_rope_cos_sin)
def rope_cos_sin_op(positions: Tensor, head_dim: int, theta: float,
                    scaling: Optional[str]) -> tuple[Tensor, Tensor]:
    """fp32 ``(cos, sin)`` ``[*positions.shape, head_dim]``; ``scaling`` encodes the rope-scaling dict
    (:func:`_encode_scaling`)."""
    return reference_rope.rope_cos_sin(positions, head_dim, theta, _decode_scaling(scaling))


@register_fake(rope_cos_sin_op)
def _rope_cos_sin_fake(positions, head_dim, theta, scaling):
    shape = (*positions.shape, head_dim)
    return (positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32))


def _check_apply_rope(x, cos, sin) -> None:
    reference_rope.check_rope_inputs(x, cos, sin)


@define_op("apply_rope", cuda="triton_elementwise.apply_rope_forward_cuda", check=_check_apply_rope,
           outputs_like=("x",))
def apply_rope_op(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return reference_rope.apply_rope_forward(x, cos, sin)


@define_op("apply_rope_backward", cuda="triton_elementwise.apply_rope_backward_cuda",
           check=_check_apply_rope, outputs_like=("grad",))
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


def apply_rope_input_grad(grad: Tensor, cos: Tensor, sin: Tensor, x_dtype: torch.dtype) -> Tensor:
    """``apply_rope``'s gradient of its input ``x`` (of dtype ``x_dtype``) from the output's ``grad``."""
    return apply_rope_backward_op(grad.to(x_dtype), cos, sin)


def _backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return apply_rope_input_grad(grad, cos, sin, ctx.x_dtype), None, None


apply_rope_op.register_autograd(_backward, setup_context=_setup_context)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, H, S, D]`` by fp32 tables ``cos``/``sin`` of shape ``[B, S, D]`` or ``[S, D]``.

    ``out = x*cos + rotate_half(x)*sin`` (HF convention) in fp32, rounded once to ``x.dtype``.
    """
    return apply_rope_op(x, cos, sin)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float,
                 scaling: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """fp32 ``(cos, sin)`` tables ``[*positions.shape, head_dim]`` (see
    :func:`tpinv.kernels.reference_rope.rope_cos_sin`); ``scaling`` is HF's ``rope_scaling`` dict."""
    return rope_cos_sin_op(positions, head_dim, float(theta), _encode_scaling(scaling))
