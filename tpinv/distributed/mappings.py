"""Megatron-named autograd regions over an explicit process group, reducing in the tree order.

Each region is a mirrored pair: what one direction reduces, the other passes through,
and every reduction is :func:`tpinv.distributed.reduce.tree_all_reduce` or
:func:`tpinv.distributed.reduce.tree_reduce_scatter` of fp32 partials, so forward and backward give
the same bits at every group size.  Gathers and slices move bytes exactly.  Regions
that reduce (in either direction) take fp32 tensors only: partials must stay fp32 until
after the reduction, then be rounded once.

Tensor-parallel regions split or join the last dimension; sequence-parallel regions
split or join dimension 0.  ``group=None`` means a single rank and raises among several
ranks (:mod:`tpinv.distributed.groups`).
"""
from __future__ import annotations

import torch

from tpinv.core.autograd import apply_function
from tpinv.core.contract import DEFAULT_LEAVES, check_tp_size
from tpinv.distributed.groups import group_size, group_size_rank, resolve_group
from tpinv.distributed.reduce import all_gather, tree_all_reduce, tree_reduce_scatter

__all__ = [
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]


def _fp32_partial(region: str, x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"{region} reduces fp32 partials, got {x.dtype} of shape "
                        f"{tuple(x.shape)}; keep the partial in fp32 and round to the output "
                        f"dtype once, after the reduction")


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of ``dim`` (equal chunks in rank order)."""
    size, rank = group_size_rank(group, "group")
    if size == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % size:
        expected = list(x.shape)
        expected[dim] = f"multiple of {size}"
        raise ValueError(f"cannot split dim {dim} of shape {tuple(x.shape)} over {size} ranks; "
                         f"expected shape {expected}")
    chunk = x.shape[dim] // size
    return x.narrow(dim, rank * chunk, chunk).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, leaves):
        ctx.group, ctx.leaves = group, leaves
        return x

    @staticmethod
    def backward(ctx, grad):
        return tree_all_reduce(grad.contiguous(), ctx.group, leaves=ctx.leaves), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, leaves):
        return tree_all_reduce(x, group, leaves=leaves)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad.contiguous(), ctx.group, dim=-1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, -1), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim=0):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad.contiguous(), ctx.group, dim=ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_grad, leaves):
        ctx.group, ctx.reduce_grad, ctx.leaves = group, reduce_grad, leaves
        return all_gather(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            grad = tree_reduce_scatter(grad.contiguous(), ctx.group, dim=0, leaves=ctx.leaves)
        else:
            grad = _split(grad, ctx.group, 0)
        return grad, None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, leaves):
        ctx.group = group
        return tree_reduce_scatter(x, group, dim=0, leaves=leaves)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad.contiguous(), ctx.group, dim=0), None, None


def _group(group):
    return resolve_group(group, "group")


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group, *,
                                         leaves: int = DEFAULT_LEAVES) -> torch.Tensor:
    """Forward: identity.  Backward: tree all-reduce of the fp32 partial gradients."""
    _fp32_partial("copy_to_tensor_model_parallel_region (backward)", x)
    check_tp_size(group_size(group, "group"), leaves)
    return apply_function(_CopyToTP, x, _group(group), leaves)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group, *,
                                             leaves: int = DEFAULT_LEAVES) -> torch.Tensor:
    """Forward: tree all-reduce of fp32 partials.  Backward: identity."""
    _fp32_partial("reduce_from_tensor_model_parallel_region", x)
    return apply_function(_ReduceFromTP, x, _group(group), leaves)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: this rank's chunk of the last dim.  Backward: all-gather of the last dim."""
    return apply_function(_ScatterToTP, x, _group(group))


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather of the last dim.  Backward: this rank's chunk of the last dim."""
    return apply_function(_GatherFromTP, x, _group(group))


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, *, dim: int = 0) -> torch.Tensor:
    """Forward: this rank's chunk of dim 0 (``dim``: for ``[b, s, h]`` layouts).  Backward: all-gather of it."""
    return apply_function(_ScatterToSP, x, _group(group), dim % x.dim())


def gather_from_sequence_parallel_region(x: torch.Tensor, group, *,
                                         tensor_parallel_output_grad: bool = True,
                                         leaves: int = DEFAULT_LEAVES) -> torch.Tensor:
    """Forward: all-gather of dim 0.  Backward: tree reduce-scatter of the fp32 partial
    gradients on dim 0 (or, with ``tensor_parallel_output_grad=False``, the rank's chunk)."""
    if tensor_parallel_output_grad:
        _fp32_partial("gather_from_sequence_parallel_region (backward)", x)
        check_tp_size(group_size(group, "group"), leaves)
    return apply_function(_GatherFromSP, x, _group(group), tensor_parallel_output_grad, leaves)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, *,
                                               leaves: int = DEFAULT_LEAVES) -> torch.Tensor:
    """Forward: tree reduce-scatter of fp32 partials on dim 0.  Backward: all-gather of dim 0."""
    _fp32_partial("reduce_scatter_to_sequence_parallel_region", x)
    return apply_function(_ReduceScatterToSP, x, _group(group), leaves)
