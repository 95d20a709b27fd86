"""Vocab-parallel cross-entropy and per-token log-probs, the same bits at every TP size.

``loss = logsumexp(logits) - logits[target]``.  The max over the vocabulary is exact in any
order (an all-reduce MAX); the sum of ``exp(logit - max)`` follows the contract: each rank
reduces its ``L/C`` vocabulary leaves to an fp32 sub-tree and the tree reducer combines
them.  The target logit lives on one rank (the sum of it and zeros is exact).  The
gradient ``softmax - onehot`` is elementwise, hence invariant.  Every value is computed in fp32
from the logits in their own dtype (the promotion is exact, so no fp32 copy of the logits is
made or saved); the gradient is rounded once to the logits' dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tpinv.core.autograd import apply_function
from tpinv.core.contract import DEFAULT_LEAVES, check_divisible, check_tp_size
from tpinv.ops import sum_exp_partial
from tpinv.ops.cross_entropy import cross_entropy_grad, cross_entropy_lse
from tpinv.distributed.groups import group_size_rank
from tpinv.distributed.reduce import tree_all_reduce


def logsumexp_and_target(logits: torch.Tensor, target: torch.Tensor, group, leaves: int):
    """``(logits, logsumexp, target logit, local target index, target off this shard)`` per row, the
    last four in fp32 (the max and the target pick are exact in the logits' dtype, and the sum of
    exponentials promotes each logit exactly: the bits of an fp32 copy, without one)."""
    tp, rank = group_size_rank(group)
    check_tp_size(tp, leaves)
    v = logits.shape[-1]
    check_divisible("vocab shard", v * tp, leaves)
    m = logits.amax(dim=-1).float()
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = sum_exp_partial(logits, m, leaves // tp)
    local = target - rank * v
    outside = (local < 0) | (local >= v)
    picked = logits.gather(-1, local.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1).float()
    picked = picked.masked_fill(outside, 0.0)
    if tp > 1:
        both = tree_all_reduce(torch.stack([s, picked], dim=-1), group, leaves=leaves)
        s, picked = both[..., 0], both[..., 1]
    lse = cross_entropy_lse(s, m)   # an op: compiled, the same log as eager
    return logits, lse, picked, local, outside


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, leaves):
        x, lse, picked, local, _ = logsumexp_and_target(logits, target, group, leaves)
        ctx.save_for_backward(x, lse, local)
        return lse - picked

    @staticmethod
    def backward(ctx, dloss):
        x, lse, local = ctx.saved_tensors
        return logits_grad(x, lse, local, dloss), None, None, None


def logits_grad(x: torch.Tensor, lse: torch.Tensor, local: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
    """``(softmax - onehot) * dloss`` of the logits ``x [..., v]`` (columns ``0..v-1`` of the
    vocabulary, relative to which ``local`` indexes the targets; any other index hits none), in
    fp32 and rounded once to ``x.dtype``.  Elementwise given the row's ``lse``: the bits of an
    entry do not depend on which columns or rows are computed with it.  The arithmetic is the op
    ``tpinv::cross_entropy_grad`` (compiled code runs the eager ``exp``; on CUDA one pass)."""
    outside = (local < 0) | (local >= x.shape[-1])
    return cross_entropy_grad(x, lse, local, outside, dloss)


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, *, tp_group: Optional[dist.ProcessGroup] = None,
                                 leaves: int = DEFAULT_LEAVES) -> torch.Tensor:
    """Per-token loss (fp32) from this rank's vocabulary shard of the logits ``[..., V/C]``."""
    if label_smoothing:
        raise NotImplementedError("label_smoothing is not supported by tpinv's vocab-parallel cross-entropy")
    if target.shape != vocab_parallel_logits.shape[:-1]:
        raise ValueError(f"target has shape {tuple(target.shape)}, expected {tuple(vocab_parallel_logits.shape[:-1])}")
    return apply_function(_VocabParallelCrossEntropy, vocab_parallel_logits, target.long(), tp_group, leaves)


def vocab_parallel_log_probs(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, *,
                             tp_group: Optional[dist.ProcessGroup] = None,
                             leaves: int = DEFAULT_LEAVES) -> torch.Tensor:
    """Per-token log-probabilities of ``target`` (fp32): ``-cross_entropy``, the same bits."""
    return -vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group=tp_group, leaves=leaves)
