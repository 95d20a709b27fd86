"""The softmax family by leaves with each leaf held in shared memory (Gluon): the row kernel's bits.

Invariant kept: the bits of :func:`tpinv.kernels.triton_softmax._fused` (the one-program-per-row
kernel, whose order is the contract), as :mod:`tpinv.kernels.triton_softmax_leaves` keeps them:
the row max is the exact max of the leaf maxima (NaN if any element is NaN); a leaf's sum is
``BLOCK`` fp32 lanes, lane ``i`` adding ``exp(x - shift)`` of elements ``i, i + BLOCK, ...`` in
that order from ``+0`` (lanes past the leaf add ``exp(-inf) = +0``), folded by contiguous halving
(lane ``i`` plus lane ``i + n/2``); the leaf sums meet in the adjacent-pair tree; each output is
``(x - shift) - log(s)`` or ``div_rn(exp(x - shift), s)`` in fp32, rounded once.  Each add, exp,
log and division is the same IEEE operation on the same operands as in the row kernel, compiled
without FMA contraction (``tests/gpu/test_softmax_by_leaves.py`` compares the bytes).

Why: the Triton by-leaves kernel reads its leaf three times (max, sum, output), the last two from
L2, so every element crosses L2 four times.  Here a program copies its leaf from memory into
shared memory once (``cp.async``), takes its max there, and the sum and the output read shared
memory: each element crosses L2 once each way, and the later passes cost no memory latency.
A leaf is held as its ``BLOCK``-wide steps in up to three power-of-two buffers (5 steps = 4 + 1).

Scheduling is the Triton by-leaves kernel's: a ticket counter hands out (row, group of ``GROUP``
leaves) items in order, the programs of a row meet on a per-row counter (acquire/release atomics,
GPU scope) after the maxima and after the sums (for the statistics alone, the last leaf sums to
arrive combine the row and nobody waits), and a program takes a ticket only while it runs, so
this cannot deadlock once ``leaves / GROUP`` programs can be resident.  :func:`held_plan` says
where it runs (a leaf that fits :data:`SMEM_BUDGET`, and the table's choice); elsewhere the Triton
by-leaves kernel runs, with the same bits.
"""
from __future__ import annotations

import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

__all__ = ["softmax_rows_held", "held_plan", "HELD_CONFIG", "SMEM_BUDGET"]

#: Shared memory a program may hold its leaves in (bytes): two such programs fit an SM.
SMEM_BUDGET = 100 * 1024
#: The cp.async copy from global to shared memory (renamed ``async_load`` after Triton 3.6).
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
#: The CTA-wide barrier (``thread_barrier`` before Triton 3.7, ``barrier`` after).
_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
#: Per (input dtype, statistics alone): (num_warps, programs per SM, leaves per program), from
#: the H100 sweeps in docs/benchmarks.md; None where the L2 kernel measured faster.  Speed only:
#: no choice here moves a bit.
HELD_CONFIG = {
    (torch.float32, False): (8, 2, 1), (torch.float32, True): (8, 2, 1),
    (torch.bfloat16, False): (4, 4, 1), (torch.bfloat16, True): None,
    (torch.float16, False): (4, 4, 1), (torch.float16, True): None,
}


@gluon.jit
def _nan_max(v):
    """The exact max of a 1-D ``v`` (order-free), NaN if any element is NaN, as ``torch.amax``."""
    return gl.where(gl.max(gl.where(v != v, 1, 0), axis=0) > 0, float("nan"), gl.max(v, axis=0))


@gluon.jit
def _shift_of(m):
    """``safe_shift``: the max where finite, else 0 (NaN stays NaN)."""
    return gl.where(gl.abs(m) == float("inf"), 0.0, m)


@gluon.jit
def _fold_lanes(acc, BLOCK: gl.constexpr, LOG2_BLOCK: gl.constexpr):
    """``[BLOCK] -> scalar`` by contiguous halving: lane ``i`` plus lane ``i + n/2``, repeated."""
    for i in gl.static_range(LOG2_BLOCK):
        pairs = gl.reshape(acc, [2, BLOCK >> (i + 1)])
        acc = gl.sum(pairs, axis=0)
    return gl.sum(acc, axis=0)


@gluon.jit
def _pair_tree(v, N: gl.constexpr, LOG2_N: gl.constexpr, layout: gl.constexpr):
    """The adjacent-pair tree ``((v0+v1)+(v2+v3))+...`` of ``tree_combine``."""
    for i in gl.static_range(LOG2_N):
        pairs = gl.reshape(gl.convert_layout(v, layout), [N >> (i + 1), 2])
        v = gl.sum(pairs, axis=1)
    return gl.sum(v, axis=0)


@gluon.jit
def _held(a, b, c, g: gl.constexpr, k: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
          C: gl.constexpr, BLOCK: gl.constexpr):
    """Step ``k`` of held leaf ``g``: steps ``[0, A)`` of every leaf live in ``a``, ``[A, A + B)``
    in ``b``, the rest in ``c`` (shared-memory shapes are powers of two, so a leaf of, say, 5 steps
    is 4 + 1)."""
    if k < A:
        return a.slice((g * A + k) * BLOCK, BLOCK)
    elif k < A + B:
        return b.slice((g * B + k - A) * BLOCK, BLOCK)
    else:
        return c.slice((g * C + k - A - B) * BLOCK, BLOCK)


@gluon.jit
def _held_fp32(a, b, c, g: gl.constexpr, k: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
               C: gl.constexpr, BLOCK: gl.constexpr, lanes, leaf_len, layout: gl.constexpr):
    """Step ``k`` of held leaf ``g`` in fp32, ``-inf`` past the leaf's end (the row kernel's
    masked load)."""
    x = _held(a, b, c, g, k, A, B, C, BLOCK).load(layout).to(gl.float32)
    return gl.where(k * BLOCK + lanes < leaf_len, x, float("-inf"))


@gluon.jit
def _meet(count_ptr, target):
    """Publish this program's part (written before the call) and wait until ``target`` parts of
    the row are published; every thread's later loads see them."""
    _thread_barrier()
    seen = gl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") + 1
    while seen < target:
        seen = gl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    _thread_barrier()


@gluon.jit
def _issue(a, b, c, x_ptr, stride_x, leaf_len, item, n_items, lanes, PROGRAMS: gl.constexpr,
           GROUP: gl.constexpr, STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
           C: gl.constexpr, BLOCK: gl.constexpr):
    """Start the cp.async copies of ``item``'s leaves into ``a, b, c`` (none past the last item)
    and close them as one group: no registers are held while they fly."""
    if item < n_items:
        row = (item // PROGRAMS).to(gl.int64)
        first = (item % PROGRAMS) * GROUP
        x_first = x_ptr + row * stride_x + first.to(gl.int64) * leaf_len
        for g in gl.static_range(GROUP):
            for k in gl.static_range(STEPS):
                _async_load(_held(a, b, c, g, k, A, B, C, BLOCK),
                            x_first + g * leaf_len + k * BLOCK + lanes,
                            mask=k * BLOCK + lanes < leaf_len, eviction_policy="evict_first")
    async_copy.commit_group()


@gluon.jit
def _process(a, b, c, item, y_ptr, max_ptr, total_ptr, part_ptr, sync_ptr, leaf_len, stride_y,
             lanes, leaf_ids, MODE: gl.constexpr, LEAVES: gl.constexpr, LOG2_LEAVES: gl.constexpr,
             PROGRAMS: gl.constexpr, GROUP: gl.constexpr, STEPS: gl.constexpr, A: gl.constexpr,
             B: gl.constexpr, C: gl.constexpr, BLOCK: gl.constexpr, LOG2_BLOCK: gl.constexpr,
             lanes_layout: gl.constexpr, small_layout: gl.constexpr):
    """``item``'s leaves, already in ``a, b, c`` (what lies past a leaf's end is read as -inf):
    their max, the row's meetings, their sums and, unless statistics alone, their output."""
    row = (item // PROGRAMS).to(gl.int64)
    first = (item % PROGRAMS) * GROUP             # this item's first leaf
    parts = part_ptr + row * (2 * LEAVES)
    # 1. the exact max of the held leaves, then the row's from every program's
    run = gl.full([BLOCK], float("-inf"), gl.float32, lanes_layout)
    for g in gl.static_range(GROUP):
        for k in gl.static_range(STEPS):
            x = _held_fp32(a, b, c, g, k, A, B, C, BLOCK, lanes, leaf_len, lanes_layout)
            run = gl.maximum(run, x, propagate_nan=tl.PropagateNan.ALL)
    gl.store(parts + item % PROGRAMS, _nan_max(run))
    _meet(sync_ptr + 1 + row, PROGRAMS)
    m = _nan_max(gl.load(parts + leaf_ids, mask=leaf_ids < PROGRAMS, other=float("-inf"),
                         volatile=True))
    shift = _shift_of(m)
    # 2. each leaf's sum from shared memory: the row kernel's lanes and fold (each thread
    #    reads back the elements it copied, so no barrier is needed between the passes)
    for g in gl.static_range(GROUP):
        acc = gl.zeros([BLOCK], gl.float32, lanes_layout)
        for k in gl.static_range(STEPS):
            acc += gl.exp(_held_fp32(a, b, c, g, k, A, B, C, BLOCK, lanes, leaf_len,
                                     lanes_layout) - shift)
        gl.store(parts + LEAVES + first + g, _fold_lanes(acc, BLOCK, LOG2_BLOCK))
    if MODE == 0:
        # the statistics alone: the row's last leaf sums to arrive combine them, no one waits
        _thread_barrier()
        seen = gl.atomic_add(sync_ptr + 1 + row, 1, sem="acq_rel", scope="gpu") + 1
        if seen == 2 * PROGRAMS:
            _thread_barrier()
            total = _pair_tree(gl.load(parts + LEAVES + leaf_ids, volatile=True), LEAVES,
                               LOG2_LEAVES, small_layout)
            gl.store(max_ptr + row, m)
            gl.store(total_ptr + row, total)
    else:
        _meet(sync_ptr + 1 + row, 2 * PROGRAMS)
        total = _pair_tree(gl.load(parts + LEAVES + leaf_ids, volatile=True), LEAVES,
                           LOG2_LEAVES, small_layout)
        if first == 0:
            gl.store(max_ptr + row, m)
            gl.store(total_ptr + row, total)
        # 3. the leaves' output from shared memory, the row kernel's per-element formula
        y_first = y_ptr + row * stride_y + first.to(gl.int64) * leaf_len
        for g in gl.static_range(GROUP):
            for k in gl.static_range(STEPS):
                offs = k * BLOCK + lanes
                shifted = _held(a, b, c, g, k, A, B, C, BLOCK).load(lanes_layout).to(gl.float32) - shift
                if MODE == 1:
                    y = shifted - gl.log(total)
                else:
                    y = gl.div_rn(gl.exp(shifted), total)
                gl.store(y_first + g * leaf_len + offs, y.to(y_ptr.dtype.element_ty),
                         mask=offs < leaf_len, eviction_policy="evict_first")
    # the buffers are copied into again next: every thread is past its last read of them
    _thread_barrier()


@gluon.jit
def _softmax_held_kernel(x_ptr, y_ptr, max_ptr, total_ptr, part_ptr, sync_ptr, n_rows, leaf_len,
                         stride_x, stride_y, MODE: gl.constexpr, LEAVES: gl.constexpr,
                         LOG2_LEAVES: gl.constexpr, GROUP: gl.constexpr,
                         BLOCK: gl.constexpr, LOG2_BLOCK: gl.constexpr, STEPS: gl.constexpr,
                         A: gl.constexpr, B: gl.constexpr, C: gl.constexpr, VEC: gl.constexpr,
                         num_warps: gl.constexpr):
    lanes_layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [num_warps], [0])
    small_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    held_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    PROGRAMS: gl.constexpr = LEAVES // GROUP      # programs that meet per row
    a0 = gl.allocate_shared_memory(dtype, [GROUP * A * BLOCK], held_layout)
    b0 = gl.allocate_shared_memory(dtype, [GROUP * B * BLOCK if B > 0 else 16], held_layout)
    c0 = gl.allocate_shared_memory(dtype, [GROUP * C * BLOCK if C > 0 else 16], held_layout)
    lanes = gl.arange(0, BLOCK, layout=lanes_layout)
    leaf_ids = gl.arange(0, LEAVES, layout=small_layout)
    n_items = n_rows * PROGRAMS
    item = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    _issue(a0, b0, c0, x_ptr, stride_x, leaf_len, item, n_items, lanes, PROGRAMS, GROUP, STEPS,
           A, B, C, BLOCK)
    while item < n_items:
        async_copy.wait_group(0)
        _thread_barrier()
        _process(a0, b0, c0, item, y_ptr, max_ptr, total_ptr, part_ptr, sync_ptr, leaf_len,
                 stride_y, lanes, leaf_ids, MODE, LEAVES, LOG2_LEAVES, PROGRAMS, GROUP, STEPS,
                 A, B, C, BLOCK, LOG2_BLOCK, lanes_layout, small_layout)
        item = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        _issue(a0, b0, c0, x_ptr, stride_x, leaf_len, item, n_items, lanes, PROGRAMS, GROUP,
               STEPS, A, B, C, BLOCK)
    async_copy.wait_group(0)


def _steps(leaf_len: int, block: int) -> int:
    return -(-leaf_len // block)


def _powers(steps: int) -> tuple[int, int, int]:
    """``steps`` as ``A + B + C``, powers of two from the largest (0 where unused)."""
    parts = [1 << i for i in reversed(range(steps.bit_length())) if steps >> i & 1]
    return tuple(parts + [0] * (3 - len(parts)))


def held_plan(rows: torch.Tensor, leaves: int, block: int, stats: bool,
              config: tuple | None = None) -> tuple | None:
    """``(num_warps, programs per SM, leaves per program)`` for ``rows`` cut in ``leaves``
    (``stats``: the statistics alone), or None where this kernel does not run them: the table
    says the L2 kernel is faster, a leaf's steps are not three powers of two, or one leaf does not
    fit :data:`SMEM_BUDGET`.  ``config`` overrides the table (the group shrinks to fit)."""
    config = config or HELD_CONFIG.get((rows.dtype, stats))
    if config is None:
        return None
    warps, per_sm, group = config
    steps = _steps(rows.shape[1] // leaves, block)
    leaf_bytes = steps * block * rows.element_size()
    group = min(group, leaves)
    while group > 1 and group * leaf_bytes > SMEM_BUDGET:
        group //= 2
    if bin(steps).count("1") > 3 or group * leaf_bytes > SMEM_BUDGET:
        return None
    return warps, per_sm, group


def softmax_rows_held(rows: torch.Tensor, out, max_, total, parts, sync, leaves: int, mode: int,
                      block: int, n_programs: int, num_warps: int, group: int) -> None:
    """Launch the held-leaf kernel over the 2-D row-contiguous CUDA ``rows``, ``group`` leaves a
    program (the caller, :func:`tpinv.kernels.triton_softmax_leaves.softmax_rows_by_leaves`,
    checks, plans, allocates and zeroes ``sync``)."""
    n_rows, width = rows.shape
    leaf_len = width // leaves
    target = rows if out is None else out
    steps = _steps(leaf_len, block)
    a, b, c = _powers(steps)
    _softmax_held_kernel[(n_programs,)](
        rows, target, max_, total, parts, sync, n_rows, leaf_len, rows.stride(0), target.stride(0),
        MODE=mode, LEAVES=leaves, LOG2_LEAVES=leaves.bit_length() - 1, GROUP=group, BLOCK=block, LOG2_BLOCK=block.bit_length() - 1, STEPS=steps, A=a, B=b,
        C=c, VEC=16 // rows.element_size(), num_warps=num_warps, enable_fp_fusion=False)
