"""The softmax family on CUDA (Triton): the leaf contract over the last dim, fixed order.

Order fixed: the last dim (a vocabulary tensor parallelism may split) is cut into
``leaves`` equal contiguous leaves.  One leaf's sum of ``exp(x - shift)`` is
:func:`_leaf_sums_exp`: a vector of ``BLOCK`` fp32 lanes walks the leaf in ``BLOCK``-wide
steps from the leaf's start (lane ``i`` adds elements ``i, i + BLOCK, ...`` in that order;
lanes past the leaf's end add ``exp(-inf) = +0``, an exact identity), then the lanes are
folded by contiguous halving (lane ``i`` plus lane ``i + n/2``, repeated), one IEEE add per
element per step.  The split kernel runs it for one leaf per program, the fused kernel for
a group of leaves side by side: the same adds either way.  ``BLOCK`` is a function of the leaf length only (:func:`leaf_block`),
and the order is written out in the code, so it depends on neither ``num_warps`` nor the
register layout.  The fp32 leaf sums are combined by the adjacent-pair tree
``((l0+l1)+(l2+l3))+...`` -- :func:`tpinv.core.contract.tree_combine` on the split path, the same
adds in-kernel on the fused path.

A leaf's sum depends on its own elements and ``shift`` alone: not on the row count, other
rows, padding rows, the launch grid, or how many leaves the caller's slice holds.  So ``C``
slices, each given to :func:`sum_exp_partial_cuda` with ``leaves // C``, combine
(``tree_combine`` in rank order) to the bits the fused kernel computes for the whole row.

``m`` is the exact row max (any order; NaN propagates as in ``torch.amax``); a row whose max
is infinite is shifted by 0 (:func:`tpinv.kernels.reference_softmax.safe_shift`).  Per element,
in fp32 and rounded once to the output dtype (:func:`_write_chunk`, shared by the fused
kernel and the from-parts kernel)::

    log_softmax = (x - shift) - log(s)      softmax = exp(x - shift) / s   (division rounded)

``logsumexp = logsumexp_from_parts(m, s)`` in torch, as on the split path (where the held
kernel runs, its combine launch takes the same operations:
:func:`tpinv.kernels.triton_softmax_combine.logsumexp_of`).  The kernels are
compiled without FMA contraction, so each formula is the same instruction sequence in both
kernels.  Semantics are those of :mod:`tpinv.kernels.reference_softmax`; bits may differ from it.

The fused kernel (:func:`_softmax_rows_kernel`) runs a persistent grid (a fixed number of
programs per SM, each looping over rows): one program reads its row for the max, re-reads
it for the leaf sums and again for the output.  Rows of a large vocabulary in flight do not
fit in L2, so each pass reads memory; rows of several long leaves run one program per leaf
instead, with these same jit functions and bits
(:mod:`tpinv.kernels.triton_softmax_leaves`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpinv.kernels.device import sm_count
from tpinv.kernels.launch import cdiv, launch, next_power_of_2, rows_2d
from tpinv.core.contract import tree_combine
from tpinv.kernels.reference_softmax import (check_partial_inputs, check_softmax_inputs,
                                       logsumexp_from_parts, safe_shift)

__all__ = ["sum_exp_partial_cuda", "max_and_sum_exp_cuda", "softmax_forward_cuda",
           "log_softmax_forward_cuda", "logsumexp_forward_cuda", "softmax_from_parts_cuda",
           "log_softmax_from_parts_cuda", "leaf_block"]

_MAX_LEAF_BLOCK = 4096
_OUT_BLOCK = 4096
_MODE_STATS, _MODE_LOG, _MODE_SOFTMAX = 0, 1, 2

#: Fused kernel per input dtype: (row chunk of the max/output passes, num_warps, programs
#: per SM (a fraction keeps fewer rows in flight), leaves summed side by side, L2 eviction
#: hints on, software-pipeline stages of the row loops).  Fixed per dtype, never chosen from
#: the row count; none of them moves bits (the max is exact, the output elementwise, the
#: leaf sums have their own fixed lane order).
_FUSED_CONFIG = {
    torch.float32: (8192, 8, 2, 4, True, 3),
    torch.bfloat16: (16384, 4, 4, 4, True, 3),
    torch.float16: (16384, 4, 4, 4, True, 3),
}
#: Programs of the persistent grid off CUDA (the interpreter): few, so rows loop.
_PROGRAMS_OFF_CUDA = 3


def leaf_block(leaf_len: int) -> int:
    """Accumulator width for a leaf of ``leaf_len`` elements (leaf length only)."""
    return max(16, min(_MAX_LEAF_BLOCK, next_power_of_2(max(leaf_len, 1))))


def _log2(n: int) -> int:
    return n.bit_length() - 1


@triton.jit
def _pair_tree(v, N: tl.constexpr, LOG2_N: tl.constexpr):
    """The adjacent-pair tree ``((v0+v1)+(v2+v3))+...`` of ``tree_combine``."""
    for i in tl.static_range(LOG2_N):
        v = tl.sum(tl.reshape(v, [N >> (i + 1), 2]), axis=1)
    return tl.sum(v, axis=0)


@triton.jit
def _fold_lanes(acc, GROUP: tl.constexpr, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    """``[GROUP, BLOCK] -> [GROUP]`` by contiguous halving: ``v[:, :n/2] + v[:, n/2:]`` repeated."""
    for i in tl.static_range(LOG2_BLOCK):
        acc = tl.sum(tl.reshape(acc, [GROUP, 2, BLOCK >> (i + 1)]), axis=1)
    return tl.sum(acc, axis=1)


@triton.jit
def _leaf_sums_exp(base, leaf_len, shift, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                   LOG2_BLOCK: tl.constexpr, POLICY: tl.constexpr, STAGES: tl.constexpr):
    """``[GROUP]`` fp32 sums of ``exp(x - shift)``, one per leaf of ``GROUP`` leaves from ``base``.

    Leaf ``g``, lane ``i`` adds elements ``i, i + BLOCK, ...`` of leaf ``g`` in that order
    (lanes past the leaf's end add ``exp(-inf) = +0``, exact); then each leaf's lanes are
    folded by contiguous halving.  Every add is a named IEEE add of the same two operands
    whatever ``GROUP``, ``num_warps`` or ``POLICY`` (an L2 eviction hint) is.
    """
    lanes = tl.arange(0, BLOCK)[None, :]
    leaf_at = tl.arange(0, GROUP)[:, None] * leaf_len
    acc = tl.zeros([GROUP, BLOCK], dtype=tl.float32)
    for start in tl.range(0, leaf_len, BLOCK, num_stages=STAGES):
        inside = tl.broadcast_to(start + lanes < leaf_len, [GROUP, BLOCK])
        x = tl.load(base + leaf_at + start + lanes, mask=inside, other=float("-inf"),
                    eviction_policy=POLICY)
        acc += tl.exp(x.to(tl.float32) - shift)
    return _fold_lanes(acc, GROUP, BLOCK, LOG2_BLOCK)


@triton.jit
def _shift_of(m):
    """``safe_shift``: the max where finite, else 0 (NaN stays NaN)."""
    return tl.where(tl.abs(m) == float("inf"), 0.0, m)


@triton.jit
def _nan_max(v):
    """The exact max of ``v`` (order-free), NaN if any element is NaN, as ``torch.amax``."""
    return tl.where(tl.max(tl.where(v != v, 1, 0), axis=0) > 0, float("nan"), tl.max(v, axis=0))


@triton.jit
def _span_max(base, n, CHUNK: tl.constexpr, POLICY: tl.constexpr, STAGES: tl.constexpr):
    """:func:`_nan_max` of the fp32 values of ``base[0:n]``, read in ``CHUNK``-wide steps."""
    offs = tl.arange(0, CHUNK)
    run = tl.full([CHUNK], float("-inf"), tl.float32)
    for start in tl.range(0, n, CHUNK, num_stages=STAGES):
        x = tl.load(base + start + offs, mask=start + offs < n, other=float("-inf"),
                    eviction_policy=POLICY)
        run = tl.maximum(run, x.to(tl.float32), propagate_nan=tl.PropagateNan.ALL)
    return _nan_max(run)


@triton.jit
def _write_chunk(x_row, y_row, offs, width, shift, total, LOG: tl.constexpr,
                 POLICY: tl.constexpr):
    ok = offs < width
    x = tl.load(x_row + offs, mask=ok, other=0.0, eviction_policy=POLICY)
    shifted = x.to(tl.float32) - shift
    if LOG:
        y = shifted - tl.log(total)
    else:
        y = tl.math.div_rn(tl.exp(shifted), total)
    tl.store(y_row + offs, y.to(y_row.dtype.element_ty), mask=ok, eviction_policy=POLICY)


@triton.jit
def _leaf_sum_exp_kernel(x_ptr, shift_ptr, out_ptr, leaf_len, stride_x, n_leaves,
                         BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    leaf = tl.program_id(1)
    shift = tl.load(shift_ptr + row)
    base = x_ptr + row * stride_x + leaf.to(tl.int64) * leaf_len
    sums = _leaf_sums_exp(base, leaf_len, shift, 1, BLOCK, LOG2_BLOCK, "", 1)
    tl.store(out_ptr + row * n_leaves + leaf + tl.arange(0, 1), sums)


@triton.jit
def _from_parts_kernel(x_ptr, shift_ptr, total_ptr, y_ptr, width, stride_x, stride_y,
                       LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _write_chunk(x_ptr + row * stride_x, y_ptr + row * stride_y, offs, width,
                 tl.load(shift_ptr + row), tl.load(total_ptr + row), LOG, "")


@triton.jit
def _softmax_rows_kernel(x_ptr, y_ptr, max_ptr, total_ptr, n_rows, width, leaf_len,
                         stride_x, stride_y, MODE: tl.constexpr, ROW_BLOCK: tl.constexpr,
                         LEAVES: tl.constexpr, LOG2_LEAVES: tl.constexpr, GROUP: tl.constexpr,
                         LEAF_BLOCK: tl.constexpr, LOG2_LEAF_BLOCK: tl.constexpr,
                         KEEP: tl.constexpr, DROP: tl.constexpr, STAGES: tl.constexpr):
    offs = tl.arange(0, ROW_BLOCK)
    group_ids = tl.arange(0, LEAVES // GROUP)[:, None]
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        x_row = x_ptr + row * stride_x
        # 1. the exact row max (order-free); a NaN lane makes the max NaN, as torch.amax does
        m = _span_max(x_row, width, ROW_BLOCK, KEEP, STAGES)
        shift = _shift_of(m)
        # 2. leaf sums (the split path's code), GROUP leaves at a time, then the pair tree
        sums = tl.zeros([LEAVES // GROUP, GROUP], dtype=tl.float32)
        for g in range(0, LEAVES // GROUP):
            part = _leaf_sums_exp(x_row + g * GROUP * leaf_len, leaf_len, shift, GROUP,
                                  LEAF_BLOCK, LOG2_LEAF_BLOCK, KEEP if MODE != 0 else DROP, STAGES)
            sums = tl.where(group_ids == g, part[None, :], sums)
        total = _pair_tree(tl.reshape(sums, [LEAVES]), LEAVES, LOG2_LEAVES)
        tl.store(max_ptr + row, m)
        tl.store(total_ptr + row, total)
        # 3. the output, same code as the from-parts kernel
        if MODE != 0:
            y_row = y_ptr + row * stride_y
            for start in tl.range(0, width, ROW_BLOCK, num_stages=STAGES):
                _write_chunk(x_row, y_row, start + offs, width, shift, total, MODE == 1, DROP)



def _programs(n_rows: int, device: torch.device, per_sm: float) -> int:
    if device.type == "cuda":
        return max(1, min(n_rows, int(per_sm * sm_count(device))))
    return max(1, min(n_rows, _PROGRAMS_OFF_CUDA))


def _outputs(rows: torch.Tensor, mode: int) -> tuple:
    """Uninitialized ``(out or None, max, total)`` of a fused launch over ``rows``."""
    max_ = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    out = None if mode == _MODE_STATS else torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    return out, max_, torch.empty_like(max_)


def _fused(rows: torch.Tensor, leaves: int, mode: int, config: tuple | None = None,
           lse: torch.Tensor | None = None):
    """``(out or None, max, total)`` for a 2-D row-contiguous ``rows``: one launch (with no
    ``config``, long CUDA rows of several leaves run one program per leaf, same bits:
    :mod:`tpinv.kernels.triton_softmax_leaves`, which may also write the statistics' logsumexp
    into ``lse`` and return it as ``out``)."""
    if config is None and _by_leaves.runs_by_leaves(rows, leaves, mode):
        return _by_leaves.softmax_rows_by_leaves(rows, leaves, mode, lse=lse)
    n_rows, width = rows.shape
    out, max_, total = _outputs(rows, mode)
    if n_rows == 0:
        return out, max_, total
    row_block, warps, per_sm, group, evict, stages = config or _FUSED_CONFIG[rows.dtype]
    leaf_len = width // leaves
    block = leaf_block(leaf_len)
    target = rows if out is None else out
    grid = (_programs(n_rows, rows.device, per_sm),)
    launch(_softmax_rows_kernel, grid,
        rows, target, max_, total, n_rows, width, leaf_len, rows.stride(0), target.stride(0),
        MODE=mode, ROW_BLOCK=row_block, LEAVES=leaves, LOG2_LEAVES=_log2(leaves),
        GROUP=min(group, leaves), LEAF_BLOCK=block, LOG2_LEAF_BLOCK=_log2(block),
        KEEP="evict_last" if evict else "", DROP="evict_first" if evict else "", STAGES=stages,
        num_warps=warps, enable_fp_fusion=False)
    return out, max_, total


def sum_exp_partial_cuda(x: torch.Tensor, max_: torch.Tensor, leaves: int) -> torch.Tensor:
    """fp32 sub-tree of ``exp(x - max)`` over this slice's ``leaves`` leaves, ``x.shape[:-1]``."""
    check_partial_inputs(x, max_, leaves)
    rows = rows_2d(x)
    shift = safe_shift(max_).reshape(-1).contiguous()
    n_rows, width = rows.shape
    leaf_len = width // leaves
    partials = torch.empty((n_rows, leaves), dtype=torch.float32, device=rows.device)
    if n_rows:
        block = leaf_block(leaf_len)
        launch(_leaf_sum_exp_kernel, (n_rows, leaves),
            rows, shift, partials, leaf_len, rows.stride(0), leaves, BLOCK=block,
            LOG2_BLOCK=_log2(block), num_warps=8 if block >= 2048 else 4,
            enable_fp_fusion=False)
    return tree_combine(partials).reshape(x.shape[:-1])


def max_and_sum_exp_cuda(x: torch.Tensor, leaves: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(m, s)`` of the last dim in one launch: the exact max and the leaf-tree sum.

    ``s`` has the bits of ``tree_combine`` over ``C`` slices' :func:`sum_exp_partial_cuda`
    (each with ``leaves // C``) given the same ``m``.  Shapes ``x.shape[:-1]``.
    """
    check_softmax_inputs(x, leaves, "max_and_sum_exp")
    _, max_, total = _fused(rows_2d(x), leaves, _MODE_STATS)
    return max_.reshape(x.shape[:-1]), total.reshape(x.shape[:-1])


def _from_parts(x: torch.Tensor, max_: torch.Tensor, total: torch.Tensor, log: bool,
                name: str) -> torch.Tensor:
    for what, t in (("max", max_), ("sum_exp", total)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} {what} must be an fp32 tensor, got {getattr(t, 'dtype', t)}")
        if tuple(t.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"{name} {what} must have shape {tuple(x.shape[:-1])} (x.shape[:-1] "
                             f"for x of shape {tuple(x.shape)}), got {tuple(t.shape)}")
    check_softmax_inputs(x, 1, name)
    rows = rows_2d(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        shift = safe_shift(max_).reshape(-1).contiguous()
        grid = (rows.shape[0], cdiv(rows.shape[1], _OUT_BLOCK))
        launch(_from_parts_kernel, grid, rows, shift, total.reshape(-1).contiguous(), out, rows.shape[1],
                                 rows.stride(0), out.stride(0), LOG=log, BLOCK=_OUT_BLOCK,
                                 num_warps=8, enable_fp_fusion=False)
    return out.reshape(x.shape)


def log_softmax_from_parts_cuda(x: torch.Tensor, max_: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``(x - m) - log(s)`` for a (local slice) ``x``; the fused kernel's bits for that slice."""
    return _from_parts(x, max_, total, True, "log_softmax_from_parts")


def softmax_from_parts_cuda(x: torch.Tensor, max_: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``exp(x - m) / s`` for a (local slice) ``x``; the fused kernel's bits for that slice."""
    return _from_parts(x, max_, total, False, "softmax_from_parts")


def softmax_forward_cuda(x: torch.Tensor, leaves: int) -> torch.Tensor:
    """``exp(x - m) / s`` over the last dim, rounded once to ``x.dtype``; one launch."""
    check_softmax_inputs(x, leaves, "softmax")
    return _fused(rows_2d(x), leaves, _MODE_SOFTMAX)[0].reshape(x.shape)


def log_softmax_forward_cuda(x: torch.Tensor, leaves: int) -> torch.Tensor:
    """``(x - m) - log(s)`` over the last dim, rounded once to ``x.dtype``; one launch."""
    check_softmax_inputs(x, leaves, "log_softmax")
    return _fused(rows_2d(x), leaves, _MODE_LOG)[0].reshape(x.shape)


def logsumexp_forward_cuda(x: torch.Tensor, leaves: int) -> torch.Tensor:
    """``m + log(s)`` over the last dim (``x.shape[:-1]``), rounded once to ``x.dtype``: taken in
    the held kernel's combine launch where it runs, else by :func:`logsumexp_from_parts` (the
    same operations, the same bits)."""
    check_softmax_inputs(x, leaves, "logsumexp")
    rows = rows_2d(x)
    lse = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    written, max_, total = _fused(rows, leaves, _MODE_STATS, lse=lse)
    if written is None:
        written = logsumexp_from_parts(max_, total).to(x.dtype)
    return written.reshape(x.shape[:-1])


import tpinv.kernels.triton_softmax_leaves as _by_leaves  # noqa: E402  (it imports this module's jit helpers)
