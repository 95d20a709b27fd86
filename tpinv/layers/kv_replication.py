"""KV-head replication: attention at a TP size above the number of KV heads.

With ``TP = R * num_kv_heads`` each KV head's ``k_proj``/``v_proj`` rows are held by the
``R`` consecutive ranks of a *replica group* (Megatron's layout), each rank keeping
``num_heads / TP`` query heads.  Invariant: every query head's output and every gradient
-- queries, keys, values and the replicated weights -- have the bits of TP=1.

The one cross-head sum here is the GQA sum of ``dK``/``dV`` over the query heads of a KV
head.  Instead of splitting that sum across the replica group (which would need the
kernel's fp32 partials and its exact order across ranks), the query heads of the replica
group are gathered exactly (bytes only) before attention, so each rank of the group runs
the whole group's attention -- the call TP=1 makes for that KV head -- and keeps its own
query heads' output.  In backward the output gradients are gathered the same way, so
every replica computes the full, identical ``dK``/``dV`` (already whole: no reduction of
the replicas' gradients is needed) and keeps its own query heads' ``dQ``.
Gathers run over the TP group (no extra process groups); they move activations only,
never weights.
"""
from __future__ import annotations

import torch

from tpinv.core.autograd import apply_function
from tpinv.distributed.groups import group_size_rank
from tpinv.distributed.reduce import all_gather

__all__ = ["gather_replica_heads", "split_replica_heads"]


def _group_heads(x: torch.Tensor, group, replicas: int) -> torch.Tensor:
    """All-gather ``x [B, h, S, D]`` over the TP group; keep this rank's replica group's heads."""
    rank, h = group_size_rank(group)[1], x.shape[1]
    full = all_gather(x.contiguous(), group, dim=1)
    return full.narrow(1, (rank // replicas) * replicas * h, replicas * h).contiguous()


def _own_heads(x: torch.Tensor, group, replicas: int) -> torch.Tensor:
    """This rank's ``1/replicas`` of the replica group's heads ``x [B, R*h, S, D]``."""
    h = x.shape[1] // replicas
    return x.narrow(1, (group_size_rank(group)[1] % replicas) * h, h).contiguous()


class _GatherReplicaHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, replicas):
        ctx.group, ctx.replicas = group, replicas
        return _group_heads(x, group, replicas)

    @staticmethod
    def backward(ctx, grad):
        return _own_heads(grad, ctx.group, ctx.replicas), None, None


class _SplitReplicaHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, replicas):
        ctx.group, ctx.replicas = group, replicas
        return _own_heads(x, group, replicas)

    @staticmethod
    def backward(ctx, grad):
        return _group_heads(grad, ctx.group, ctx.replicas), None, None


def gather_replica_heads(x: torch.Tensor, group, replicas: int) -> torch.Tensor:
    """Forward: the query heads ``[B, R*h, S, D]`` of this rank's replica group (exact gather).
    Backward: this rank's own heads of the (identical on every replica) gradient."""
    if replicas == 1:
        return x
    return apply_function(_GatherReplicaHeads, x, group, replicas)


def split_replica_heads(x: torch.Tensor, group, replicas: int) -> torch.Tensor:
    """Forward: this rank's own heads of the replica group's output.  Backward: the replica
    group's output gradients, gathered exactly, so every replica back-propagates the whole group."""
    if replicas == 1:
        return x
    return apply_function(_SplitReplicaHeads, x, group, replicas)
