"""``tpinv::silu_mul``: ``silu(gate) * up`` as a torch.library custom op.

Each output element depends only on its own ``gate`` and ``up`` values (see
:mod:`tpinv.kernels.reference_activation`: no ``torch.sigmoid``/``F.silu``, whose results depend
on an element's position), so the result is the same bits at any batch size, layout,
chunking or thread count.  On CUDA the Triton kernels of
:mod:`tpinv.kernels.triton_elementwise` run (named in the op definitions below).  No double backward.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tpinv.kernels import reference_activation
from tpinv.ops.registry import define_op, register_fake

__all__ = ["silu_mul", "silu_mul_op", "silu_mul_backward_op"]


def _check_silu_mul(gate, up) -> None:
    reference_activation.check_silu_mul_inputs(gate, up)


def _check_silu_mul_backward(grad, gate, up) -> None:
    reference_activation.check_silu_mul_inputs(gate, up)


@define_op("silu_mul", cuda="triton_elementwise.silu_mul_forward_cuda", check=_check_silu_mul)
def silu_mul_op(gate: Tensor, up: Tensor) -> Tensor:
    return reference_activation.silu_mul_forward(gate, up)


@define_op("silu_mul_backward", cuda="triton_elementwise.silu_mul_backward_cuda",
           check=_check_silu_mul_backward)
def silu_mul_backward_op(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return reference_activation.silu_mul_backward(grad, gate, up)


@register_fake(silu_mul_op)
def _silu_mul_fake(gate, up):
    return torch.empty_like(gate)


@register_fake(silu_mul_backward_op)
def _silu_mul_backward_fake(grad, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    gate, up = ctx.saved_tensors
    return silu_mul_backward_op(grad, gate, up)


silu_mul_op.register_autograd(_backward, setup_context=_setup_context)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """Invariant ``silu(gate) * up`` (same shape and dtype), fp32 inside, rounded once."""
    return silu_mul_op(gate, up)
