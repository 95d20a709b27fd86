"""The softmax family by leaves with each leaf held in shared memory (Gluon): the row kernel's bits.

Invariant kept: the bits of :func:`tpinv.kernels.triton_softmax._fused` (the one-program-per-row
kernel, whose order is the contract), as :mod:`tpinv.kernels.triton_softmax_leaves` keeps them:
the row max is the exact max of the leaf maxima (NaN if any element is NaN); a leaf's sum is
``BLOCK`` fp32 lanes, lane ``i`` adding ``exp(x - shift)`` of elements ``i, i + BLOCK, ...`` in
that order from ``+0`` (lanes past the leaf add ``exp(-inf) = +0``), folded by contiguous halving
(lane ``i`` plus lane ``i + n/2``); the leaf sums meet in the adjacent-pair tree; each output is
``(x - shift) - log(s)`` or ``div_rn(exp(x - shift), s)`` in fp32, rounded once.  Each add, exp,
log and division is the same IEEE operation on the same operands as in the row kernel, compiled
without FMA contraction (``tests/gpu/test_softmax_by_leaves.py`` compares the bytes); where a
leaf's floor (a value no element is below) shows that no exp can round below 2**-126, each exp
is the one hardware instruction the row kernel's exp reduces to there, and where it also shows
that no quotient comes near underflow, softmax's correctly rounded division is taken from the
row's reciprocal with two fused corrections (the same bits; ``tests/gpu/test_softmax_quotient.py``).
A held leaf's arithmetic (exp, sum, fold, pair tree, quotient) is
:mod:`tpinv.kernels.gluon_softmax_leaf`, its max pass :mod:`tpinv.kernels.gluon_softmax_extremes`;
this module schedules them.

Why: the Triton by-leaves kernel reads its leaf three times (max, sum, output), the last two from
L2, so every element crosses L2 four times.  Here a program copies its leaf from memory into
shared memory once (``cp.async``, one group a step), takes its max there, each step as soon as
its copy has landed, and the sum and the output read shared memory: each element crosses L2
once each way, and the later passes cost no memory latency.
A leaf is held as its ``BLOCK``-wide steps in up to three power-of-two buffers (5 steps = 4 + 1),
each step copied and read a tile of the row layout at a time; the last step's tiles that lie
wholly past the leaf's end are neither copied nor read (their lanes would add ``+0``, which
leaves a sum as it is: a Qwen3 leaf of 18,992 elements computes 19,456 lanes, not 20,480).
Where the whole leaf does not fit the table's programs an SM, the last step's last tiles are
read from global memory in every pass instead
(:func:`~tpinv.kernels.gluon_softmax_plan.held_buffers`; fp32 at three programs an SM: 560 of
18,992 elements), the same operations on the same values.
fp32 softmax writes each exp of its sum over its element, so its output pass divides without
a second exp.

Scheduling is the Triton by-leaves kernel's: a ticket counter hands out (row, leaf) items in order,
the programs of a row meet after the maxima and after the sums (the statistics alone publish their
leaf sums and wait for nobody; a second small kernel,
:func:`~tpinv.kernels.triton_softmax_combine.combine_sums`, takes each row's total after the
launch, and for ``logsumexp`` the row's logsumexp with it), and a
program takes a ticket only while it runs, so this cannot deadlock once
``leaves`` programs can be resident.  Where the table says so, the programs an SM holds start one
after another (:func:`_stagger`, a fixed delay each), so that they copy while others compute
instead of all copying, then all computing.  A meeting is one 64-bit slot per leaf, zero before the
launch: a program publishes its value's bits with a written flag in one atomic exchange, and each
thread holds all of the row's slots and polls them on its own until every flag is set, taking the
values from that same load (no block barrier, no counter, no second round trip; no shuffle inside
the polling loop, so threads may leave it at different polls).  Where it runs and in what shape
(a leaf that fits, the table's choice, the programs an SM and the tiles held) is
:mod:`tpinv.kernels.gluon_softmax_plan` (:func:`held_plan`); elsewhere the Triton by-leaves
kernel runs, with the same bits.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from tpinv.kernels import gluon_softmax_plan as plan
from tpinv.kernels.gluon_softmax_leaf import (exp_never_flushes, exp_shifted, fold_lanes,
                                             held_tile, leaf_sum, leaf_tile,
                                             nan_max, pair_tree, quotient_by_reciprocal,
                                             reciprocal_divides_exactly, shift_of,
                                             tile_holds_elements, tile_in_memory,
                                             tile_is_partial, widened)
from tpinv.kernels.gluon_softmax_extremes import leaf_extremes
from tpinv.kernels.gluon_softmax_plan import held_plan
from tpinv.kernels.launch import launch
from tpinv.kernels.triton_softmax_combine import combine_sums

__all__ = ["held_plan", "softmax_rows_held"]

#: The cp.async copy from global to shared memory (renamed ``async_load`` after Triton 3.6).
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
#: The CTA-wide barrier (``thread_barrier`` before Triton 3.7, ``barrier`` after).
_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _publish(slot_ptr, value):
    """Publish the fp32 ``value`` in its row's slot: its bits and a written flag in one 64-bit
    word (the slots are zero before the launch), so a reader gets both in one load."""
    word = (value.to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF) | 0x100000000
    gl.atomic_xchg(slot_ptr, word, sem="relaxed", scope="gpu")


@gluon.jit
def _gather(slot_ptr, ids):
    """The fp32 values of the slots ``ids``, once every one of them is published.  Each thread
    holds all of them and polls on its own: no barrier, no counter, no shuffle in the loop."""
    words = gl.load(slot_ptr + ids, volatile=True)
    while gl.min(words >> 32, axis=0) == 0:
        words = gl.load(slot_ptr + ids, volatile=True)
    return (words & 0xFFFFFFFF).to(gl.int32).to(gl.float32, bitcast=True)


@gluon.jit
def _issue(a, b, c, x_ptr, stride_x, leaf_len, item, n_items, lanes, LEAVES: gl.constexpr,
           STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr, BLOCK: gl.constexpr,
           TILE: gl.constexpr, LIVE: gl.constexpr, PARTIAL: gl.constexpr, HELD: gl.constexpr):
    """Start the cp.async copies of ``item``'s leaf into ``a, b, c`` (none past the last item,
    none for a tile wholly past the leaf's end or read from memory, :func:`tile_in_memory`),
    each step's closed as one group (``STEPS`` groups, empty past the last item), so that the
    max pass reads each step once its group has landed
    (:func:`~tpinv.kernels.gluon_softmax_extremes.leaf_extremes`): no registers are held while
    they fly."""
    row = (item // LEAVES).to(gl.int64)
    x_leaf = x_ptr + row * stride_x + (item % LEAVES).to(gl.int64) * leaf_len
    for k in gl.static_range(STEPS):
        if item < n_items:
            for t in gl.static_range(BLOCK // TILE):
                _copy_tile(a, b, c, x_leaf, k * BLOCK + t * TILE + lanes, leaf_len, k, t, STEPS,
                           A, B, BLOCK, TILE, LIVE, PARTIAL, HELD)
        async_copy.commit_group()


@gluon.jit
def _copy_tile(a, b, c, x_leaf, offs, leaf_len, k: gl.constexpr, t: gl.constexpr,
               STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr, BLOCK: gl.constexpr,
               TILE: gl.constexpr, LIVE: gl.constexpr, PARTIAL: gl.constexpr,
               HELD: gl.constexpr):
    """Start the cp.async copy of tile ``t`` of step ``k`` (elements ``offs``) of the leaf at
    ``x_leaf`` into its place in ``a, b, c``: none for a tile wholly past the leaf's end or read
    from memory in each pass (:func:`tile_in_memory`), masked at the leaf's end."""
    if not tile_in_memory(k, t, STEPS, HELD):
        if tile_is_partial(k, t, STEPS, LIVE, PARTIAL):
            _async_load(held_tile(a, b, c, k, t, A, B, BLOCK, TILE), x_leaf + offs,
                        mask=offs < leaf_len, eviction_policy="evict_first")
        elif tile_holds_elements(k, t, STEPS, LIVE):
            _async_load(held_tile(a, b, c, k, t, A, B, BLOCK, TILE), x_leaf + offs,
                        eviction_policy="evict_first")


@gluon.jit
def _write_leaf(a, b, c, x_leaf, y_leaf, shift, total, recip, lanes, leaf_len, x_next, has_next,
                MODE: gl.constexpr, STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
                BLOCK: gl.constexpr, TILE: gl.constexpr, LIVE: gl.constexpr,
                PARTIAL: gl.constexpr, HELD: gl.constexpr, lanes_layout: gl.constexpr,
                FAST: gl.constexpr, KEPT_EXP: gl.constexpr, PREFETCH: gl.constexpr):
    """The leaf's output from shared memory, the row kernel's per-element formula: ``(x - shift)
    - log(total)`` (``MODE`` 1) or ``div_rn(exp(x - shift), total)``, with ``FAST`` (where
    :func:`reciprocal_divides_exactly` holds) the hardware ex2 alone and the quotient from the
    row's reciprocal ``recip`` (:func:`quotient_by_reciprocal`): the same bits.  With
    ``KEPT_EXP`` the leaf holds the sum's ``exp(x - shift)`` (:func:`leaf_sum`), not ``x``, in
    its held tiles; a tile read from memory takes its exps again (the same bits).  With
    ``PREFETCH`` (the cluster kernel's, :data:`~tpinv.kernels.gluon_softmax_plan.PREFETCHED`)
    each held tile, once its output is stored, is copied from ``x_next`` (the next leaf, where
    ``has_next``) into the same place, and each step's copies close as one group, as
    :func:`_issue` closes them (the next row's max pass waits for them step by step): a thread
    copies the very elements it has itself read (one layout for copies and reads), and
    its store used what it read, so no read is overwritten before it is done (Triton still puts
    a block barrier before each such copy)."""
    for k in gl.static_range(STEPS):
        for t in gl.static_range(BLOCK // TILE):
            if tile_holds_elements(k, t, STEPS, LIVE):   # a tile past the leaf's end: nothing
                offs = k * BLOCK + t * TILE + lanes
                held = leaf_tile(a, b, c, x_leaf, k, t, A, B, BLOCK, TILE, lanes, leaf_len,
                                 lanes_layout, STEPS, LIVE, PARTIAL, HELD)
                held = widened(held)
                if MODE == 1:
                    y = (held - shift) - gl.log(total)
                else:
                    if KEPT_EXP and not tile_in_memory(k, t, STEPS, HELD):   # the sum's exps
                        e = held
                    elif FAST:
                        e = exp_shifted(held - shift, True)
                    else:
                        e = gl.exp(held - shift)
                    if FAST:
                        y = quotient_by_reciprocal(e, total, recip)
                    else:
                        y = gl.div_rn(e, total)
                y = y.to(y_leaf.dtype.element_ty)
                if tile_is_partial(k, t, STEPS, LIVE, PARTIAL):
                    gl.store(y_leaf + offs, y, mask=offs < leaf_len, eviction_policy="evict_first")
                else:
                    gl.store(y_leaf + offs, y, eviction_policy="evict_first")
                if PREFETCH:
                    # the next leaf's copy of this tile: this thread's own elements, read above
                    # (the store used them), so no other thread's read is overwritten
                    if has_next:
                        _copy_tile(a, b, c, x_next, offs, leaf_len, k, t, STEPS, A, B, BLOCK,
                                   TILE, LIVE, PARTIAL, HELD)
        if PREFETCH:
            async_copy.commit_group()


@gluon.jit
def _sum_lanes(a, b, c, x_leaf, shift, lo, lanes, leaf_len, MODE: gl.constexpr,
               STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr, BLOCK: gl.constexpr,
               TILE: gl.constexpr, LIVE: gl.constexpr, PARTIAL: gl.constexpr,
               HELD: gl.constexpr, lanes_layout: gl.constexpr):
    """The leaf's sum lanes (:func:`leaf_sum`) for a leaf no element of which is below ``lo``, each
    exp the hardware ex2 alone where ``lo`` shows it is (-inf, NaN or a value about 87.3 below the
    row max in the leaf take the general exp); fp32 softmax keeps each exp in the leaf in place
    of its element, for its quotients."""
    KEEP: gl.constexpr = MODE == 2 and a.dtype == gl.float32
    if exp_never_flushes(lo, shift):
        acc = leaf_sum(a, b, c, x_leaf, shift, lanes, leaf_len, A, B, BLOCK, TILE, STEPS, LIVE,
                       PARTIAL, HELD, lanes_layout, True, KEEP)
    else:
        acc = leaf_sum(a, b, c, x_leaf, shift, lanes, leaf_len, A, B, BLOCK, TILE, STEPS, LIVE,
                       PARTIAL, HELD, lanes_layout, False, KEEP)
    return acc


@gluon.jit
def _write_output(a, b, c, x_leaf, y_leaf, shift, total, lo, lanes, leaf_len, x_next, has_next,
                  MODE: gl.constexpr, STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
                  BLOCK: gl.constexpr, TILE: gl.constexpr, LIVE: gl.constexpr,
                  PARTIAL: gl.constexpr, HELD: gl.constexpr, lanes_layout: gl.constexpr,
                  PREFETCH: gl.constexpr):
    """The leaf's output (``MODE`` 1: log_softmax, 2: softmax) by :func:`_write_leaf`, softmax's
    quotients from the row's reciprocal where :func:`reciprocal_divides_exactly` holds for the
    leaf's floor ``lo``, by ``div_rn`` elsewhere (the same bits)."""
    if MODE == 1:
        _write_leaf(a, b, c, x_leaf, y_leaf, shift, total, total, lanes, leaf_len, x_next,
                    has_next, MODE, STEPS, A, B, BLOCK, TILE, LIVE, PARTIAL, HELD, lanes_layout,
                    False, False, PREFETCH)
    else:
        KEEP: gl.constexpr = a.dtype == gl.float32     # the sum kept its exps (_sum_lanes)
        recip = gl.div_rn(1.0, total)
        if reciprocal_divides_exactly(lo, shift, total):
            _write_leaf(a, b, c, x_leaf, y_leaf, shift, total, recip, lanes, leaf_len, x_next,
                        has_next, MODE, STEPS, A, B, BLOCK, TILE, LIVE, PARTIAL, HELD,
                        lanes_layout, True, KEEP, PREFETCH)
        else:
            _write_leaf(a, b, c, x_leaf, y_leaf, shift, total, recip, lanes, leaf_len, x_next,
                        has_next, MODE, STEPS, A, B, BLOCK, TILE, LIVE, PARTIAL, HELD,
                        lanes_layout, False, KEEP, PREFETCH)


@gluon.jit
def _process(a, b, c, item, x_ptr, y_ptr, max_ptr, total_ptr, slot_ptr, leaf_len, stride_x,
             stride_y, lanes, leaf_ids, MODE: gl.constexpr, LEAVES: gl.constexpr,
             LOG2_LEAVES: gl.constexpr, STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
             BLOCK: gl.constexpr, TILE: gl.constexpr, LOG2_TILE: gl.constexpr,
             LIVE: gl.constexpr, PARTIAL: gl.constexpr, HELD: gl.constexpr,
             lanes_layout: gl.constexpr, small_layout: gl.constexpr, fold_layout: gl.constexpr):
    """``item``'s leaf, already in ``a, b, c`` (what lies past its end is read as -inf): its max,
    the row's meetings, its sum and, unless statistics alone, its output."""
    row = (item // LEAVES).to(gl.int64)
    leaf = item % LEAVES
    slots = slot_ptr + row * (2 * LEAVES)   # the leaf maxima, then the leaf sums
    x_leaf = x_ptr + row * stride_x + leaf.to(gl.int64) * leaf_len   # for tiles not held
    # 1. the leaf's exact max and a floor, then the row's max from every leaf's
    m_leaf, lo = leaf_extremes(a, b, c, x_leaf, lanes, leaf_len, A, B, BLOCK, TILE, STEPS, LIVE,
                               PARTIAL, HELD, lanes_layout)
    _publish(slots + leaf, m_leaf)
    m = nan_max(_gather(slots, leaf_ids))
    shift = shift_of(m)
    # every thread past its meeting: the sum pass reads the leaf from shared memory again
    # rather than the compiler keeping the max pass's loads live across the meeting (which
    # spilled 16-bit log_softmax: 104 local loads, 90 stores a thread; none with this)
    _thread_barrier()
    # 2. the leaf's sum
    acc = _sum_lanes(a, b, c, x_leaf, shift, lo, lanes, leaf_len, MODE, STEPS, A, B, BLOCK, TILE,
                     LIVE, PARTIAL, HELD, lanes_layout)
    _publish(slots + LEAVES + leaf, fold_lanes(acc, TILE, LOG2_TILE, fold_layout))
    if MODE == 0:
        # the statistics alone: nobody waits; combine_sums takes the row's total after the launch
        if leaf == 0:
            gl.store(max_ptr + row, m)
    else:
        total = pair_tree(_gather(slots + LEAVES, leaf_ids), LEAVES, LOG2_LEAVES, small_layout)
        if leaf == 0:
            gl.store(max_ptr + row, m)
            gl.store(total_ptr + row, total)
        # 3. the leaf's output from shared memory
        y_leaf = y_ptr + row * stride_y + leaf.to(gl.int64) * leaf_len
        _write_output(a, b, c, x_leaf, y_leaf, shift, total, lo, lanes, leaf_len, x_leaf, False,
                      MODE, STEPS, A, B, BLOCK, TILE, LIVE, PARTIAL, HELD, lanes_layout, False)
    # the buffers are copied into again next: every thread is past its last read of them
    _thread_barrier()


@gluon.jit
def _timer_ns():
    """The GPU's global nanosecond timer (read anew each call)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                     is_pure=False, pack=1)


#: The staggered starts' arrival counts a launch reads: one per SM id (``%smid`` modulo this).
ARRIVAL_SLOTS = 1024
_ARRIVAL_SLOTS = gl.constexpr(ARRIVAL_SLOTS)


@gluon.jit
def _sm_id():
    """The SM this program runs on (it stays there until it exits)."""
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _stagger(sm_count_ptr, unit_ns, SLOTS: gl.constexpr):
    """Hold this program ``k * unit_ns`` before its first ticket, ``k`` its arrival order on its
    SM modulo ``SLOTS``: the programs an SM holds then copy and compute in different phases
    rather than all copying, then all computing.  Scheduling only: no value depends on it."""
    k = gl.atomic_add(sm_count_ptr + _sm_id() % _ARRIVAL_SLOTS, 1, sem="relaxed",
                      scope="gpu") % SLOTS
    wait = k.to(gl.int64) * unit_ns
    start = _timer_ns()
    while _timer_ns() - start < wait:
        pass


@gluon.jit
def _unstagger(sm_count_ptr):
    """Take back, as the program exits, the arrival :func:`_stagger` counted on its SM: once a
    launch's programs have all exited, each SM's count is where it was before the launch, so a
    count left at zero serves every later launch on the stream (nothing zeroed a call:
    :func:`tpinv.kernels.launch_counters.counters`).
    Scheduling only: no value depends on it."""
    gl.atomic_add(sm_count_ptr + _sm_id() % _ARRIVAL_SLOTS, -1, sem="relaxed", scope="gpu")


@gluon.jit
def _softmax_held_kernel(x_ptr, y_ptr, max_ptr, total_ptr, slot_ptr, sync_ptr, n_rows, leaf_len,
                         stride_x, stride_y, stagger_ns, MODE: gl.constexpr, LEAVES: gl.constexpr,
                         LOG2_LEAVES: gl.constexpr, BLOCK: gl.constexpr, TILE: gl.constexpr,
                         LOG2_TILE: gl.constexpr, LIVE: gl.constexpr, PARTIAL: gl.constexpr,
                         HELD: gl.constexpr, STEPS: gl.constexpr, A: gl.constexpr,
                         B: gl.constexpr, C_LANES: gl.constexpr,
                         VEC: gl.constexpr, STAGGER: gl.constexpr, fold_layout: gl.constexpr,
                         num_warps: gl.constexpr):
    lanes_layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [num_warps], [0])
    small_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    held_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    a = gl.allocate_shared_memory(dtype, [A * BLOCK], held_layout)
    b = gl.allocate_shared_memory(dtype, [B * BLOCK if B > 0 else 16], held_layout)
    c = gl.allocate_shared_memory(dtype, [C_LANES], held_layout)
    lanes = gl.arange(0, TILE, layout=lanes_layout)   # one tile of the row layout
    # every thread holds all of a row's slots: a poll reduces in-thread, with no shuffle inside
    # the polling loop (lanes leave it at different polls; a warp-wide shuffle there would
    # wait for lanes that already left)
    slot_layout: gl.constexpr = gl.BlockedLayout([LEAVES], [32], [num_warps], [0])
    leaf_ids = gl.arange(0, LEAVES, layout=slot_layout)
    n_items = n_rows * LEAVES
    if STAGGER > 1:
        _stagger(sync_ptr + 2, stagger_ns, STAGGER)
    item = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    _issue(a, b, c, x_ptr, stride_x, leaf_len, item, n_items, lanes, LEAVES, STEPS, A, B, BLOCK,
           TILE, LIVE, PARTIAL, HELD)
    while item < n_items:
        _process(a, b, c, item, x_ptr, y_ptr, max_ptr, total_ptr, slot_ptr, leaf_len, stride_x,
                 stride_y, lanes, leaf_ids, MODE, LEAVES, LOG2_LEAVES, STEPS, A, B, BLOCK, TILE,
                 LOG2_TILE, LIVE, PARTIAL, HELD, lanes_layout, small_layout, fold_layout)
        item = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        _issue(a, b, c, x_ptr, stride_x, leaf_len, item, n_items, lanes, LEAVES, STEPS, A, B,
               BLOCK, TILE, LIVE, PARTIAL, HELD)


def softmax_rows_held(rows: torch.Tensor, out, max_, total, leaves: int, mode: int, block: int,
                      n_programs: int, num_warps: int, per_sm: float, stagger_ns: int,
                      lse: torch.Tensor | None = None) -> None:
    """Launch the held-leaf kernel over the 2-D row-contiguous CUDA ``rows`` (the caller,
    :func:`tpinv.kernels.triton_softmax_leaves.softmax_rows_by_leaves`, checks, plans and
    allocates the outputs), ``per_sm`` programs an SM, each program an SM holds starting
    ``stagger_ns`` after the one before it there (0: all at once); the statistics alone
    (``mode`` 0) then take each row's total, and its logsumexp into ``lse`` where given, by
    :func:`combine_sums`.  Where the plan's :data:`~tpinv.kernels.gluon_softmax_plan.CLUSTERED`
    names the dtype and mode, a row's leaves meet in one thread-block cluster instead
    (:func:`tpinv.kernels.gluon_softmax_cluster.softmax_rows_clustered`; the same bits)."""
    if (rows.dtype, mode) in plan.CLUSTERED:
        from tpinv.kernels.gluon_softmax_cluster import CLUSTER_LEAVES, softmax_rows_clustered
        if leaves in CLUSTER_LEAVES:
            softmax_rows_clustered(rows, out, max_, total, leaves, mode, block, n_programs,
                                   num_warps, per_sm, stagger_ns, lse)
            return
    n_rows, width = rows.shape
    leaf_len = width // leaves
    target = rows if out is None else out
    options = plan.held_launch_options(rows.element_size(), leaf_len, leaves, mode, block,
                                       num_warps, per_sm, stagger_ns)
    slots_per_sm = options["STAGGER"]
    # one zeroed buffer: the rows' meeting slots, the ticket counter (int32, padded to 64
    # bits), then (staggered starts) an arrival count per SM (int32)
    zeroed = torch.zeros(n_rows * 2 * leaves + 1 + (ARRIVAL_SLOTS // 2 if slots_per_sm else 0),
                         dtype=torch.int64, device=rows.device)
    slots = zeroed[:n_rows * 2 * leaves]
    sync = zeroed[n_rows * 2 * leaves:].view(torch.int32)
    launch(_softmax_held_kernel, (n_programs,),
           rows, target, max_, total, slots, sync, n_rows, leaf_len, rows.stride(0), target.stride(0),
           stagger_ns if slots_per_sm else 0, **options)
    if mode == 0:
        combine_sums(slots, max_, total, leaves, lse)
