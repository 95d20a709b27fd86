"""RMSNorm layers: the plain one over the hidden size, and Qwen3's per-head q/k norm.

Invariant: the forward and the input gradient are row-wise (a row's bits do not depend on the
other rows).  The weight gradient of :class:`HeadRMSNorm`, a weight shared by all heads while
TP splits the heads, gathers the per-head token sums exactly across the TP group and adds them
over *all* heads in a fixed order on every rank, so every TP size gets the same bits.  With
sequence parallelism :class:`RMSNorm` runs on sequence chunks and its weight gradient is the
whole sequence's token sum, in the order of SP off.
"""
from __future__ import annotations

import torch

from tpinv.core.autograd import apply_function
from tpinv.distributed.groups import group_size, group_size_rank
from tpinv.distributed.reduce import all_gather
from tpinv.ops import rms_norm, tree_sum
from tpinv.ops.norm import rms_norm_backward_heads_op, rms_norm_backward_op, rms_norm_op

__all__ = ["RMSNorm", "HeadRMSNorm", "head_rms_norm", "head_rms_norm_backward"]


class _SequenceParallelRMSNorm(torch.autograd.Function):
    """RMSNorm of this rank's sequence chunk; the weight gradient of the *whole* sequence.

    The forward and ``dx`` are row-wise, so the chunk's rows have the bits of the full call.
    The weight gradient is a token sum that sequence parallelism would split across ranks:
    backward gathers ``x`` and ``dy`` exactly along the sequence and runs the one full
    backward call (the token chain of SP off), then keeps this rank's rows of ``dx``.  Every
    rank gets the same weight gradient, with the bits of SP off.
    """

    @staticmethod
    def forward(ctx, x, weight, eps, group, seq_dim):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.group, ctx.seq_dim = eps, group, seq_dim
        return rms_norm_op(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full_x = all_gather(x, ctx.group, dim=ctx.seq_dim)
        full_grad = all_gather(grad.contiguous(), ctx.group, dim=ctx.seq_dim)
        dx, dw = rms_norm_backward_op(full_grad, full_x, weight, ctx.eps)
        n = x.shape[ctx.seq_dim]
        dx = dx.narrow(ctx.seq_dim, group_size_rank(ctx.group)[1] * n, n).contiguous()
        return dx, dw, None, None, None


class RMSNorm(torch.nn.Module):
    """``weight * x / rms(x)`` over the last dim (tpinv's fixed-order ``rms_norm``).

    With ``sequence_parallel_group`` the input is this rank's chunk of dim ``seq_dim`` and the
    weight gradient is that of the whole sequence (Megatron's ``sequence_parallel`` norms,
    whose weight gradients it all-reduces; here it is computed whole, in the fixed order)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, *, sequence_parallel_group=None,
                 seq_dim: int = 1):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))
        self.sp_group, self.seq_dim = sequence_parallel_group, seq_dim
        if sequence_parallel_group is not None:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_group is None or group_size(self.sp_group) == 1:
            return rms_norm(x, self.weight, self.eps)
        return apply_function(_SequenceParallelRMSNorm, x.contiguous(), self.weight, float(self.eps), self.sp_group,
                              self.seq_dim % x.dim())


class _HeadRMSNorm(torch.autograd.Function):
    """RMSNorm of every head of ``x [..., heads, D]`` with one shared ``weight [D]``.

    Forward and ``dx`` are one call each (rows are independent, so a head's bits are those
    of a call on that head alone).  The weight gradient is each head's own token sum
    (:func:`tpinv.ops.norm.rms_norm_backward_heads_op`), gathered exactly across the TP
    group (rank order = head order) and summed over *all* heads by a fixed halving, so
    every rank and every TP size gets the same bits.
    """

    @staticmethod
    def forward(ctx, x, weight, eps, group, replicas=1):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.group, ctx.replicas = eps, group, replicas
        return rms_norm_op(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return (*head_rms_norm_backward(grad, x, weight, ctx.eps, ctx.group, ctx.replicas), None, None, None)


def head_rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, group,
                           replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of :func:`head_rms_norm`: ``dweight`` the same at every TP size."""
    grad_x, per_head = rms_norm_backward_heads_op(grad.contiguous(), x, weight, eps)
    if group_size(group) > 1:
        per_head = all_gather(per_head.contiguous(), group, dim=0)
    if replicas > 1:  # replicated KV heads: R identical consecutive rows per head, keep one
        per_head = per_head.view(-1, replicas, per_head.shape[-1])[:, 0]
    # the fp32 halving over all heads, as an op: a compiled graph calls it as one opaque kernel
    return grad_x, tree_sum(per_head.t(), 1).to(weight.dtype)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group, replicas: int = 1) -> torch.Tensor:
    """RMSNorm over the last dim of every head of ``x [..., heads, D]`` (one shared weight),
    with a weight gradient that is the same at every TP size (``group``: the TP group;
    ``replicas``: ranks holding each head, for replicated KV heads)."""
    if isinstance(x, torch.Tensor):  # the op checks the inputs (once, at its kernel's entry)
        x = x.contiguous()
    eps = float(eps) if isinstance(eps, (int, float)) else eps
    return apply_function(_HeadRMSNorm, x, weight, eps, group, replicas)


class HeadRMSNorm(RMSNorm):
    """RMSNorm over head_dim applied to each head of ``x [B, S, heads, D]`` (Qwen3 q/k norm)."""

    def __init__(self, head_dim: int, eps: float, dtype: torch.dtype, group, replicas: int = 1):
        super().__init__(head_dim, eps, dtype)
        self.group, self.replicas = group, replicas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head_rms_norm(x, self.weight, self.eps, self.group, self.replicas)
