"""``tpinv::rms_norm``: a torch.library custom op over :mod:`tpinv.kernels.reference_norm`.

The op keeps the kernel's order: the hidden sum of each row and the token sum of the
weight gradient are fixed ``leaf_tree_sum(., 1)`` chains, so a row's output and input
gradient do not depend on the batch, strides, padding rows or thread count.  The CPU
kernel is registered here; on CUDA the Triton kernels of :mod:`tpinv.kernels.triton_norm`
(named in the op definitions below).  The backward is itself a custom op
(``tpinv::rms_norm_backward``; it has no double backward), and
``tpinv::rms_norm_backward_heads`` returns one weight-gradient row per head for Qwen3's q/k norm.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tpinv.kernels import reference_norm
from tpinv.ops.registry import define_op, register_fake

__all__ = ["rms_norm", "rms_norm_op", "rms_norm_backward_op", "rms_norm_backward_heads_op"]


def _check_rms_norm(x, weight, eps) -> None:
    reference_norm.check_rms_norm_inputs(x, weight, eps)


def _check_rms_norm_backward(grad, x, weight, eps) -> None:
    reference_norm.check_rms_norm_inputs(x, weight, eps)


def _check_rms_norm_backward_heads(grad, x, weight, eps) -> None:
    reference_norm.check_rms_norm_inputs(x, weight, eps)
    reference_norm.check_per_head_inputs(x)


@define_op("rms_norm", cuda="triton_norm.rms_norm_forward_cuda", check=_check_rms_norm)
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return reference_norm.rms_norm_forward(x, weight, eps)


@define_op("rms_norm_backward", cuda="triton_norm.rms_norm_backward_cuda", check=_check_rms_norm_backward)
def rms_norm_backward_op(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return reference_norm.rms_norm_backward(grad, x, weight, eps)


@define_op("rms_norm_backward_heads", cuda="triton_norm.rms_norm_backward_heads_cuda",
           check=_check_rms_norm_backward_heads)
def rms_norm_backward_heads_op(grad: Tensor, x: Tensor, weight: Tensor,
                               eps: float) -> tuple[Tensor, Tensor]:
    """For ``x [..., heads, H]``: ``(dx, dweight [heads, H])``, each head's token sum apart."""
    return reference_norm.rms_norm_backward_heads(grad, x, weight, eps)


@register_fake(rms_norm_backward_heads_op)
def _rms_norm_backward_heads_fake(grad, x, weight, eps):
    return torch.empty_like(x), weight.new_empty((x.shape[-2], x.shape[-1]))


@register_fake(rms_norm_op)
def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=reference_norm.rms_norm_out_dtype(x, weight))


@register_fake(rms_norm_backward_op)
def _rms_norm_backward_fake(grad, x, weight, eps):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = rms_norm_backward_op(grad, x, weight, ctx.eps)
    return grad_x, grad_weight, None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Invariant RMSNorm over the last dim (HF Llama/Qwen3 semantics).

    ``x [..., H]``, ``weight [H]``; returns ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``
    in the promoted dtype of ``x`` and ``weight``.  The mean is the fixed-order sum divided
    by ``H``.
    """
    return rms_norm_op(x, weight, float(eps) if isinstance(eps, (int, float)) else eps)
