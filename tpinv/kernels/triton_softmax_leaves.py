"""The fused softmax family on CUDA with one program per leaf: the row kernel's bits, L2-sized.

Invariant kept: the bits of :func:`tpinv.kernels.triton_softmax._fused` (the one-program-per-row
kernel, whose order is the contract): the leaf's max, the leaf's sum of ``exp(x - shift)``
(:func:`~tpinv.kernels.triton_softmax._leaf_sums_exp`, the same lanes and fold), the
adjacent-pair tree over the row's leaf sums (``_pair_tree``), the per-element output
(``_write_chunk``) and the max (``_span_max``, ``_nan_max``) are the row kernel's own jit
functions, called on the same operands.  The row max is the max of the leaf maxima: exact and
order-free, NaN if any element is NaN.

Why: the row kernel reads a row three times (max, sums, output).  A 151936-wide fp32 row is
593 KB, so the rows in flight do not fit in L2 and every pass comes from memory.  Here a row's
leaves are taken by different programs, each reading only its leaf (74 KB) three times, so the
leaves in flight fit in L2 and the row comes from memory once.

The programs of a row meet twice: each publishes its leaf max, waits until the row's ``leaves``
maxima are published, then does the same with its leaf sum (for the statistics alone, with no
output to write, nobody waits the second time: the row's last leaf sum to arrive combines them).
A counter per row (acquire/release atomics, GPU scope) carries each meeting.  Work is handed out
by a ticket counter in ticket order -- the row's leaves are consecutive tickets -- and a program
takes a ticket only while it runs, so at most one row is ever partly taken and every other row a
waiting program belongs to is wholly held by running programs: this cannot deadlock once
``leaves`` programs can be resident at once (any GPU, any launch order).  Not for Triton's
interpreter, which runs programs one after another: there the row kernel runs.

On an sm_90 GPU a leaf that fits shared memory is held there instead of re-read through L2
(:mod:`tpinv.kernels.gluon_softmax`, the same schedule and bits, meetings by flagged slots),
where its table says so.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpinv.kernels.device import gluon_device_reason, gluon_module
from tpinv.kernels.launch import launch
from tpinv.kernels.triton_softmax import (_MODE_STATS, _leaf_sums_exp, _log2, _nan_max, _outputs,
                                          _pair_tree, _programs, _shift_of, _span_max, _write_chunk,
                                          leaf_block)

__all__ = ["softmax_rows_by_leaves", "runs_by_leaves", "held_module", "BY_LEAVES", "HELD", "MIN_LEAF_LEN"]

#: ``[True]``: on CUDA, rows of at least two leaves of :data:`MIN_LEAF_LEN` or more run here;
#: ``[False]``: every row runs the row kernel (tests compare the two).
BY_LEAVES = [True]
#: ``[True]``: leaves that fit shared memory on an sm_90 GPU are held there
#: (:mod:`tpinv.kernels.gluon_softmax`); ``[False]``: they are read through L2 three times.
HELD = [True]
#: Shortest leaf worth a program of its own (shorter rows fit in L2 as whole rows).
MIN_LEAF_LEN = 2048

#: Per (input dtype, statistics alone): (chunk of the max/output passes, num_warps, programs per
#: SM, pipeline stages), the best of the H100 sweeps in docs/benchmarks.md.  None of it moves a bit.
_CONFIG = {
    (torch.float32, False): (8192, 8, 4, 2), (torch.float32, True): (8192, 8, 4, 1),
    (torch.bfloat16, False): (4096, 4, 4, 2), (torch.bfloat16, True): (4096, 4, 8, 1),
    (torch.float16, False): (4096, 4, 4, 2), (torch.float16, True): (4096, 4, 8, 1),
}


@triton.jit
def _meet(count_ptr, target):
    """Publish this program's part (written before the call) and wait until ``target`` parts of
    the row are published; every thread's later loads see them."""
    tl.debug_barrier()
    seen = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") + 1
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _softmax_leaves_kernel(x_ptr, y_ptr, max_ptr, total_ptr, part_ptr, sync_ptr, n_rows, leaf_len,
                           stride_x, stride_y, MODE: tl.constexpr, CHUNK: tl.constexpr,
                           LEAVES: tl.constexpr, LOG2_LEAVES: tl.constexpr,
                           LEAF_BLOCK: tl.constexpr, LOG2_LEAF_BLOCK: tl.constexpr,
                           STAGES: tl.constexpr):
    offs = tl.arange(0, CHUNK)
    leaf_ids = tl.arange(0, LEAVES)
    n_items = n_rows * LEAVES
    item = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    while item < n_items:
        row = (item // LEAVES).to(tl.int64)
        leaf = item % LEAVES
        x_leaf = x_ptr + row * stride_x + leaf.to(tl.int64) * leaf_len
        parts = part_ptr + row * (2 * LEAVES)
        # 1. the leaf's exact max (NaN if any element is NaN), then the row's from all leaves
        tl.store(parts + leaf, _span_max(x_leaf, leaf_len, CHUNK, "evict_last", STAGES))
        _meet(sync_ptr + 1 + row, LEAVES)
        m = _nan_max(tl.load(parts + leaf_ids, volatile=True))
        shift = _shift_of(m)
        # 2. the leaf's sum (the row kernel's lanes and fold), then the pair tree over the leaves
        leaf_sum = _leaf_sums_exp(x_leaf, leaf_len, shift, 1, LEAF_BLOCK, LOG2_LEAF_BLOCK,
                                  "evict_last" if MODE != 0 else "evict_first", STAGES)
        tl.store(parts + LEAVES + leaf + tl.arange(0, 1), leaf_sum)
        if MODE == 0:
            # the statistics alone: the row's last leaf sum to arrive combines them, no one waits
            tl.debug_barrier()
            seen = tl.atomic_add(sync_ptr + 1 + row, 1, sem="acq_rel", scope="gpu") + 1
            if seen == 2 * LEAVES:
                tl.debug_barrier()
                total = _pair_tree(tl.load(parts + LEAVES + leaf_ids, volatile=True), LEAVES,
                                   LOG2_LEAVES)
                tl.store(max_ptr + row, m)
                tl.store(total_ptr + row, total)
        else:
            _meet(sync_ptr + 1 + row, 2 * LEAVES)
            total = _pair_tree(tl.load(parts + LEAVES + leaf_ids, volatile=True), LEAVES, LOG2_LEAVES)
            if leaf == 0:
                tl.store(max_ptr + row, m)
                tl.store(total_ptr + row, total)
            # 3. the leaf's output, the row kernel's per-element code
            y_leaf = y_ptr + row * stride_y + leaf.to(tl.int64) * leaf_len
            for start in tl.range(0, leaf_len, CHUNK, num_stages=STAGES):
                _write_chunk(x_leaf, y_leaf, start + offs, leaf_len, shift, total, MODE == 1,
                             "evict_first")
        item = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")


def held_module(rows: torch.Tensor, leaf_len: int):
    """:mod:`tpinv.kernels.gluon_softmax` where its kernel may run ``rows`` (an sm_90 GPU, Gluon,
    16-byte aligned rows and leaves; :data:`HELD` on; a Triton whose Gluon it is written for:
    :func:`~tpinv.kernels.device.gluon_device_reason`), else None; its ``held_plan`` decides."""
    if not HELD[0] or gluon_device_reason(rows.device) is not None:
        return None
    held = gluon_module("gluon_softmax")
    aligned = (leaf_len % 16 == 0 and rows.stride(0) % 16 == 0 and rows.data_ptr() % 16 == 0)
    return held if held is not None and aligned else None


def softmax_rows_by_leaves(rows: torch.Tensor, leaves: int, mode: int,
                           config: tuple | None = None, held_config: tuple | None = None,
                           lse: torch.Tensor | None = None) -> tuple:
    """``(out or None, max, total)`` of a 2-D row-contiguous CUDA ``rows`` (checked by the caller),
    the bits of the row kernel.  The leaf is held in shared memory where it can be
    (:func:`held_module`; ``held_config``: its (num_warps, programs per SM, stagger_ns)),
    else read three times through L2 (``config``: (chunk, num_warps, programs per SM, stages)).
    The statistics alone (``mode`` 0) with ``lse`` (one element a row) write each row's
    logsumexp there where the held kernel runs, and return it as ``out`` (else None)."""
    n_rows, width = rows.shape
    out, max_, total = _outputs(rows, mode)
    if n_rows == 0:
        return out, max_, total
    leaf_len = width // leaves
    block = leaf_block(leaf_len)
    held = None if config is not None else held_module(rows, leaf_len)
    plan = None if held is None else held.held_plan(rows, leaves, block, mode,
                                                    held_config)
    if plan is not None:
        warps, per_sm, stagger_ns = plan
        n_programs = max(leaves, _programs(n_rows * leaves, rows.device, per_sm))
        lse = lse if mode == _MODE_STATS else None
        held.softmax_rows_held(rows, out, max_, total, leaves, mode, block, n_programs, warps,
                               per_sm, stagger_ns, lse)
        return (lse if lse is not None else out), max_, total
    parts = torch.empty((n_rows, 2 * leaves), dtype=torch.float32, device=rows.device)
    sync = torch.zeros(n_rows + 1, dtype=torch.int32, device=rows.device)  # ticket, then a count per row
    chunk, warps, per_sm, stages = config or _CONFIG[rows.dtype, mode == _MODE_STATS]
    grid = (max(leaves, _programs(n_rows * leaves, rows.device, per_sm)),)
    target = rows if out is None else out
    launch(_softmax_leaves_kernel, grid,
           rows, target, max_, total, parts, sync, n_rows, leaf_len, rows.stride(0), target.stride(0),
           MODE=mode, CHUNK=chunk, LEAVES=leaves, LOG2_LEAVES=_log2(leaves), LEAF_BLOCK=block,
           LOG2_LEAF_BLOCK=_log2(block), STAGES=stages, num_warps=warps, enable_fp_fusion=False)
    return out, max_, total


def runs_by_leaves(rows: torch.Tensor, leaves: int, mode: int) -> bool:
    """Whether :func:`tpinv.kernels.triton_softmax._fused` hands ``rows`` to this kernel."""
    return (BY_LEAVES[0] and rows.device.type == "cuda" and leaves >= 2
            and rows.shape[1] // leaves >= MIN_LEAF_LEN)
