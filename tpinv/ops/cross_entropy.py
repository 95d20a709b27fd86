"""``tpinv::cross_entropy_lse`` and ``tpinv::cross_entropy_grad``: the elementwise ends of the
vocab-parallel cross-entropy (:mod:`tpinv.layers.cross_entropy`) as ops.

Their arithmetic is elementwise (no reduction), but it calls ``log`` and ``exp``: as ops,
torch.compile runs the eager kernel's ``log``/``exp`` instead of generating its own (inductor's
vectorized ``exp`` is not ATen's, so a compiled gradient would differ in the last bits).  The
lse kernel is the layer's own torch code, on CPU and on CUDA; the gradient's CUDA kernel is one
Triton pass (:mod:`tpinv.kernels.triton_cross_entropy`) with the reference's arithmetic and
libdevice's ``exp``: the reference's bits wherever ``exp`` is a normal float (checked on the
device by raw bytes), and the one kernel every CUDA path runs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tpinv.kernels import reference_cross_entropy
from tpinv.ops.registry import REFERENCE, define_op, register_fake

__all__ = ["cross_entropy_lse", "cross_entropy_grad", "cross_entropy_lse_op", "cross_entropy_grad_op"]


def _check_fp32(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"cross-entropy {name} must be an fp32 tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")


def _check_lse(total, row_max) -> None:
    _check_fp32(total=total, row_max=row_max)
    if total.shape != row_max.shape:
        raise ValueError(f"cross-entropy total {list(total.shape)} and row_max {list(row_max.shape)} differ in shape")


def _check_grad(x, lse, target, outside, dloss) -> None:
    _check_fp32(lse=lse, dloss=dloss)
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"cross-entropy logits x must be fp32, bf16 or fp16, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    rows = tuple(x.shape[:-1])
    for name, t in (("lse", lse), ("target", target), ("outside", outside), ("dloss", dloss)):
        if tuple(t.shape) != rows:
            raise ValueError(f"cross-entropy {name} must have the row shape {list(rows)}, got {list(t.shape)}")
    if target.dtype != torch.int64 or outside.dtype != torch.bool:
        raise TypeError(f"cross-entropy target must be int64 and outside bool, got {target.dtype}, {outside.dtype}")


@define_op("cross_entropy_lse", cuda=REFERENCE, check=_check_lse)
def cross_entropy_lse_op(total: Tensor, row_max: Tensor) -> Tensor:
    """fp32 ``log(total) + row_max``: a row's log-sum-exp from its max and its sum of ``exp(x - max)``."""
    return torch.log(total) + row_max


@register_fake(cross_entropy_lse_op)
def _lse_fake(total, row_max):
    return torch.empty_like(total)


@define_op("cross_entropy_grad", cuda="triton_cross_entropy.cross_entropy_grad_cuda", check=_check_grad)
def cross_entropy_grad_op(x: Tensor, lse: Tensor, target: Tensor, outside: Tensor, dloss: Tensor) -> Tensor:
    """``(exp(x - lse) - onehot(target)) * dloss`` over this rank's vocabulary slice ``x [..., V/C]``
    of logits (bf16, fp16 or fp32), computed in fp32 and rounded once to ``x.dtype``; ``target``
    is local to the slice, ``outside`` marks the rows whose target another rank holds."""
    return reference_cross_entropy.cross_entropy_grad(x, lse, target, outside, dloss)


@register_fake(cross_entropy_grad_op)
def _grad_fake(x, lse, target, outside, dloss):
    return torch.empty_like(x)


def cross_entropy_lse(total: Tensor, row_max: Tensor) -> Tensor:
    """fp32 ``log(total) + row_max`` (no autograd: used inside the layer's own autograd function)."""
    return cross_entropy_lse_op(total, row_max)


def cross_entropy_grad(x: Tensor, lse: Tensor, target: Tensor, outside: Tensor, dloss: Tensor) -> Tensor:
    """fp32 gradient of the per-token loss with respect to this rank's logits slice (see the op)."""
    return cross_entropy_grad_op(x, lse, target, outside, dloss)
