"""Autograd functions of the parallel linears: every cross-rank sum follows the contract.

* column-parallel: ``y_r = x @ W_r^T`` (K whole, fixed order); ``dX`` is a reduction over
  the TP-split N, so each rank computes the fp32 sub-tree of its ``L/C`` N-leaves and the
  tree reducer combines them.
* column-parallel with ``replicas`` R (TP above the KV-head count): R consecutive ranks
  hold the same rows and get the same full ``dY`` for them, so ``dW`` is already whole on
  each; for ``dX`` each of the R ranks takes its own ``1/R`` of the rows -- exactly the
  N-leaves it would own without replication -- so the tree is unchanged.
* row-parallel, ``tree``: each rank computes the fp32 sub-tree of its ``L/C`` K-leaves,
  the tree reducer combines them, one rounding.
* row-parallel, ``column_only``: all-gather the input (exact), compute an N-slice of the
  full ``L``-leaf tree, all-gather the output (exact).  Backward reduce-scatters the
  ``dX`` partials over the rank's N-leaves.  Same bits as ``tree`` by construction.

Sequence parallelism (``seq_dim``): the column layer all-gathers its input along the
sequence (exact) and keeps its sequence chunk of the full ``dX``; the row-parallel ``tree``
layer tree-reduce-scatters its fp32 partials along the sequence (chunk ``r`` of the very
tree the all-reduce computes) and all-gathers ``dY`` in backward.  Every matmul then sees
the whole sequence, so every output and gradient has the bits of SP off.

``dW`` and ``dbias`` reduce over tokens, which TP never splits: a fixed order
(``leaves=1``) on every rank.

A product no rank shares (the column forward, ``dW``, the row layer's local ``dX``) is
rounded once by :func:`tpinv.ops.matmul` -- on CUDA in the kernel's epilogue, so no fp32
tensor of the product's size exists; an fp32 partial is materialised only where it is
combined across ranks, and then :data:`PARTIAL_CHUNK_BYTES` of rows at a time.  Rounding in the epilogue or after is the same single rounding of
the same fp32 value: the same bits.
"""
from __future__ import annotations


import torch

from tpinv.core.contract import tree_combine
from tpinv.ops import matmul, matmul_partial, tree_sum
from tpinv.distributed.groups import group_size, group_size_rank
from tpinv.distributed.reduce import all_gather, tree_all_reduce, tree_reduce_scatter


#: Bytes of fp32 partials a cross-rank reduction holds at once: rows are reduced in chunks of
#: this size (each row's sum is the same whatever rows share its chunk).
PARTIAL_CHUNK_BYTES = 256 << 20


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _row_chunks(rows: int, row_bytes: int) -> list[slice]:
    step = max(1, PARTIAL_CHUNK_BYTES // max(row_bytes, 1))
    return [slice(s, s + step) for s in range(0, rows, step)]


def rounded_matmul(x: torch.Tensor, w: torch.Tensor, leaves: int) -> torch.Tensor:
    """``x @ w^T`` by the contract, rounded once to ``x.dtype`` (in the epilogue on CUDA)."""
    return matmul(x, w, leaves, 1)


def weight_grad(dy: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dW = dY^T X, reduced over the flattened tokens in a fixed order, rounded once."""
    if dy.dtype != dtype:   # one rounding, from fp32 straight to the weight's dtype
        return matmul_partial(_flat(dy).t(), _flat(x).t(), 1).to(dtype)
    return rounded_matmul(_flat(dy).t(), _flat(x).t(), 1)


def column_input_grad(dy: torch.Tensor, weight: torch.Tensor, group, leaves: int, stride: int = 1,
                      replicas: int = 1, replica_index: int = 0) -> torch.Tensor:
    """A column-parallel layer's ``dX = dY W`` (reduced over the TP-split N), rounded to ``dy.dtype``.

    With stride s (Megatron's interleaved [gate_r; up_r] shards) N is s blocks of L leaves
    each: each block is reduced by the contract, then the blocks are added by the tree.  With
    ``replicas`` R (KV-head replication) the R ranks holding the same rows each take their own
    1/R of them: rank r's N-leaves, as without replication.  Row ``t`` of the result depends
    on row ``t`` of ``dy`` only.
    """
    tp = group_size(group)
    if tp == 1 and stride == 1 and replicas == 1:   # no partial crosses ranks or blocks: rounded in the epilogue
        return rounded_matmul(dy, weight.t(), leaves)
    n = weight.shape[0] // (stride * replicas)
    off = replica_index * n
    dy2 = _flat(dy)
    chunks = _row_chunks(dy2.shape[0], 4 * stride * weight.shape[1])
    if stride == 1 and len(chunks) == 1:   # the loop below with one block and one chunk: fewer calls
        part = matmul_partial(dy2.narrow(-1, off, n), weight.narrow(0, off, n).t(), leaves // tp)
        if tp > 1:
            part = tree_all_reduce(part, group, leaves=leaves)
        return part.to(dy.dtype).reshape(*dy.shape[:-1], weight.shape[1])
    dx = torch.empty(dy2.shape[0], weight.shape[1], dtype=dy.dtype, device=dy.device)
    for rows in chunks:
        parts = torch.stack([matmul_partial(dy2[rows].narrow(-1, off + j * n, n),
                                            weight.narrow(0, off + j * n, n).t(), leaves // tp)
                             for j in range(stride)], dim=-1)
        if tp > 1:
            parts = tree_all_reduce(parts, group, leaves=leaves)
        dx[rows] = tree_combine(parts)
    return dx.reshape(*dy.shape[:-1], weight.shape[1])


def _bias_grad(dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tree_sum(_flat(dy).t(), 1).to(dtype)


def _column_dx(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group, seq_dim, leaves: int,
               reduce_dgrad: bool, stride: int, replicas: int, replica_index: int) -> torch.Tensor:
    """One column-parallel product's ``dX`` (``x``: the whole sequence), kept to this rank's
    sequence chunk under sequence parallelism."""
    dx = column_input_grad(dy.to(x.dtype), weight, group if reduce_dgrad else None, leaves, stride, replicas,
                           replica_index)
    if seq_dim is not None:  # this rank's sequence chunk of the (identical) full dX
        n = dx.shape[seq_dim] // group_size(group)
        dx = dx.narrow(seq_dim, group_size_rank(group)[1] * n, n).contiguous()
    return dx


class ColumnParallelMatmul(torch.autograd.Function):
    """``x @ W_r^T (+ b_r)``; the input's gradient is tree-reduced over the TP group."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, leaves, reduce_dgrad, stride=1, replicas=1, replica_index=0,
                seq_dim=None):
        ctx.seq_dim = seq_dim if group_size(group) > 1 else None
        ctx.save_for_backward(x, weight)  # with SP: the chunk (gathered again in backward, as Megatron)
        if ctx.seq_dim is not None:  # sequence parallel: the whole sequence, gathered exactly
            x = all_gather(x, group, dim=seq_dim)
        ctx.group, ctx.settings = group, (leaves, reduce_dgrad, stride, replicas, replica_index)
        ctx.bias_dtype = None if bias is None else bias.dtype
        y = rounded_matmul(x, weight, 1)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if ctx.seq_dim is not None:
            x = all_gather(x, ctx.group, dim=ctx.seq_dim)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _column_dx(dy, x, weight, ctx.group, ctx.seq_dim, *ctx.settings)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(dy, x, weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = _bias_grad(dy, ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None


class ColumnParallelGroupMatmul(torch.autograd.Function):
    """Column-parallel products of one input (q/k/v, gate/up) as one autograd node, with the
    bits of one :class:`ColumnParallelMatmul` node per product.

    Each output, ``dW`` and ``dbias`` is its own node's.  ``dX`` is the products' ``dX`` added
    as the autograd engine adds the separate nodes' gradients of their shared input: in the
    order the nodes run, and the engine runs the node created last first (the highest sequence
    number among ready nodes), so the first product's ``dX`` is added last.  Rounded adds of
    the same values in an order whose last term is the same give the same bits (each add is
    commutative).  ``settings[i]`` is product ``i``'s ``(leaves, reduce_dgrad, stride,
    replicas, replica_index)``; ``params`` its weights, then its biases (None where none)."""

    @staticmethod
    def forward(ctx, x, group, seq_dim, settings, *params):
        n = len(settings)
        weights, biases = params[:n], params[n:]
        ctx.seq_dim = seq_dim if group_size(group) > 1 else None
        ctx.save_for_backward(x, *weights)
        if ctx.seq_dim is not None:  # the whole sequence, gathered once for every product
            x = all_gather(x, group, dim=seq_dim)
        ctx.group, ctx.settings = group, settings
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in biases)
        outs = []
        for weight, bias in zip(weights, biases):
            y = rounded_matmul(x, weight, 1)
            outs.append(y if bias is None else y + bias)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        x, *weights = ctx.saved_tensors
        if ctx.seq_dim is not None:
            x = all_gather(x, ctx.group, dim=ctx.seq_dim)
        n = len(weights)
        needs = ctx.needs_input_grad
        dx, dws, dbs = None, [None] * n, [None] * n
        for i in reversed(range(n)):   # the engine's order of the separate nodes: last created first
            dy = dys[i]
            if needs[0]:
                dx_i = _column_dx(dy, x, weights[i], ctx.group, ctx.seq_dim, *ctx.settings[i])
                dx = dx_i if dx is None else dx + dx_i
            if needs[4 + i]:
                dws[i] = weight_grad(dy, x, weights[i].dtype)
            if ctx.bias_dtypes[i] is not None and needs[4 + n + i]:
                dbs[i] = _bias_grad(dy, ctx.bias_dtypes[i])
        return (dx, None, None, None, *dws, *dbs)


class RowParallelTreeMatmul(torch.autograd.Function):
    """``tree_all_reduce(x_r @ W_r^T over the rank's K-leaves)``, rounded once."""

    @staticmethod
    def forward(ctx, x, weight, group, leaves, seq_dim=None):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.leaves = group, leaves
        tp = group_size(group)
        ctx.seq_dim = seq_dim if tp > 1 else None
        if tp == 1:   # no partial crosses ranks: rounded in the epilogue
            return rounded_matmul(x, weight, leaves)
        if ctx.seq_dim is not None:  # sequence parallel: the same tree, each rank keeps its chunk
            part = matmul_partial(x, weight, leaves // tp)
            return tree_reduce_scatter(part, group, dim=seq_dim, leaves=leaves).to(x.dtype)
        x2 = _flat(x)
        chunks = _row_chunks(x2.shape[0], 4 * weight.shape[0])   # bounded fp32 partials
        if len(chunks) == 1:
            y = tree_all_reduce(matmul_partial(x2, weight, leaves // tp), group, leaves=leaves).to(x.dtype)
            return y.reshape(*x.shape[:-1], weight.shape[0])
        y = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        for rows in chunks:
            y[rows] = tree_all_reduce(matmul_partial(x2[rows], weight, leaves // tp), group, leaves=leaves)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if ctx.seq_dim is not None:
            dy = all_gather(dy.contiguous(), ctx.group, dim=ctx.seq_dim)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # N (the output) is whole on every rank: the full L-leaf tree, locally.
            dx = rounded_matmul(dy, weight.t(), ctx.leaves)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(dy, x, weight.dtype)
        return dx, dw, None, None, None


class RowParallelColumnOnlyMatmul(torch.autograd.Function):
    """All-gather x, N-slice of the full-K tree, all-gather y.  ``weight`` is ``[N/C, K]``."""

    @staticmethod
    def forward(ctx, x, weight, group, leaves):
        tp = group_size(group)
        x_full = all_gather(x, group, dim=-1) if tp > 1 else x
        ctx.save_for_backward(x_full, weight)
        ctx.group, ctx.leaves = group, leaves
        y = rounded_matmul(x_full, weight, leaves)
        return all_gather(y, group, dim=-1) if tp > 1 else y

    @staticmethod
    def backward(ctx, dy):
        x_full, weight = ctx.saved_tensors
        tp, rank = group_size_rank(ctx.group)
        n = weight.shape[0]
        dy_r = dy.narrow(-1, rank * n, n)
        dx = dw = None
        if ctx.needs_input_grad[0] and tp == 1:
            dx = rounded_matmul(dy_r, weight.t(), ctx.leaves)
        elif ctx.needs_input_grad[0]:
            part = matmul_partial(dy_r, weight.t(), ctx.leaves // tp)
            dx = tree_reduce_scatter(part, ctx.group, dim=-1, leaves=ctx.leaves).to(x_full.dtype)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(dy_r, x_full, weight.dtype)
        return dx, dw, None, None
