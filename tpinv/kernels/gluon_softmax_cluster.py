"""The held softmax with a row's leaves in one thread-block cluster: they meet in shared memory.

Invariant kept: the bits of :mod:`tpinv.kernels.gluon_softmax` (the row kernel's): the same leaf
arithmetic (:mod:`tpinv.kernels.gluon_softmax_leaf`) on the same held leaf, copied, summed and written by the same
:func:`~tpinv.kernels.gluon_softmax._issue`, :func:`~tpinv.kernels.gluon_softmax._sum_lanes` and
:func:`~tpinv.kernels.gluon_softmax._write_output`; only where the row's leaves meet differs.
The row max is the exact max of the leaf maxima (NaN if any is NaN, written as ``float("nan")``),
the total the adjacent-pair tree ``((s0+s1)+(s2+s3))+...`` of the leaf sums, as there.

Why: a row's leaves meeting through global memory wait for the slowest leaf's value to reach L2
and for their polls to come back from it, behind the copies streaming through the same memory
system: about 1-2 us a meeting on an H200 (docs/benchmarks.md, "The held softmax's row meetings
in a thread-block cluster").  Here the ``LEAVES`` programs of a cluster (:mod:`tpinv.kernels.
cluster_launch`) hold the leaves of one row at a time: program ``r`` of a cluster holds leaf
``r``, a cluster takes rows ``c, c + n_clusters, ...`` (the same rows for all its programs), and a
meeting is one asynchronous store of the leaf's fp32 bits into every program's shared memory
(slot ``r``; ``st.async``, which signals the receiving program's mbarrier as it lands) and a
wait on the program's own mbarrier, after which it reads the row's values from its own shared
memory: no release fence, which would wait for every earlier global store of the program (a
cluster barrier's release held 21% of the kernel's warp samples: docs/benchmarks.md, "The bf16
max pass compares raw bits").  The hardware keeps
a cluster's programs resident together, so no launch order, residency or other kernel can make
a meeting wait forever, and no global counter or memset is needed.  The statistics alone meet
once a row, for the max, and that meeting also carries each leaf's sum of the cluster's previous
row: program 0 of the cluster then takes that row's total (and its logsumexp, with the
combine's own :func:`~tpinv.kernels.triton_softmax_combine.logsumexp_of`), so nobody waits for a sum (a
second meeting a row cost fp32 statistics 9 points of copy bandwidth: docs/benchmarks.md, "The
statistics in a cluster meet once"), no second launch takes the totals, and the cluster's last
row's sums meet once after its loop.  Since a cluster's next row is known, the programs the plan
names (:data:`~tpinv.kernels.gluon_softmax_plan.PREFETCHED`) copy it into their leaf during the
output pass, each held tile as soon as its output is written, so the copy runs under the rest of
the pass (bf16 softmax 71.5 -> 73.7%, fp32 log_softmax 84.8 -> 86.3% of an H200's copy at 4096
rows; docs/benchmarks.md, "The cluster copies its next row during the output pass").
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tpinv.kernels.cluster_launch import clustered
from tpinv.kernels.gluon_softmax import (ARRIVAL_SLOTS, _issue, _stagger, _sum_lanes,
                                         _thread_barrier, _unstagger, _write_output)
from tpinv.kernels.gluon_softmax_plan import PREFETCHED, held_launch_options
from tpinv.kernels.launch_counters import counters
from tpinv.kernels.gluon_softmax_extremes import leaf_extremes
from tpinv.kernels.gluon_softmax_leaf import fold_lanes, shift_of
from tpinv.kernels.triton_softmax_combine import logsumexp_of

__all__ = ["softmax_rows_clustered", "CLUSTER_LEAVES"]

#: Leaves a row may be cut in to meet in one cluster (8: the largest portable cluster).
CLUSTER_LEAVES = (2, 4, 8)

# The meetings' shared memory, one array a program: four mbarriers, [kind][parity] (kind 0 the
# maxima, 1 the sums; parity the row's), then 64 slot words, [kind][parity][set][8] (set 1 the
# statistics' previous sums).  A program's meeting of kind k for its cluster's row i: thread 0
# expects ``4 * sets * LEAVES`` bytes on mbarrier [k][i % 2]; thread t < LEAVES stores the
# program's values into slot [rank] of program t's set [k][i % 2] with ``st.async``, which
# completes those bytes on program t's mbarrier [k][i % 2]; every thread waits for that
# mbarrier's phase (i // 2) % 2 to complete (acquire, cluster scope), then reads the set.  A
# program reaches row i + 2's meeting of a kind only after row i + 1's, which needs every
# program's value of row i + 1, which each sends only after its own row i's wait and reads: so
# no slot is overwritten before it is read and no mbarrier phase receives another row's bytes.
_SETUP_ASM = gl.constexpr("\n".join([
    "{",
    ".shared .align 16 .b8 tpinv_meetings[288];",
    ".reg .pred %tpv_first;",
    ".reg .u32 %tpv_t;",
    "mov.u32 $0, tpinv_meetings;",
    "mov.u32 %tpv_t, %tid.x;",
    "setp.eq.u32 %tpv_first, %tpv_t, 0;",
    *(f"@%tpv_first mbarrier.init.shared::cta.b64 [tpinv_meetings+{8 * i}], 1;" for i in range(4)),
    "fence.mbarrier_init.release.cluster;",
    "barrier.cluster.arrive.release.aligned;",
    "barrier.cluster.wait.acquire.aligned;",
    "}"]))
# Before a program exits: every program is past its last meeting, so no store is in flight to it.
_TEARDOWN_ASM = gl.constexpr("{ barrier.cluster.arrive.release.aligned; "
                             "barrier.cluster.wait.acquire.aligned; mov.u32 $0, 0; }")


def _meeting_asm(kind: int, sets: int) -> str:
    """The PTX of a meeting of ``kind`` (0: maxima, 1: sums) carrying ``sets`` fp32 values a
    program: operands ``$0 ..`` the eight words read from each set in turn, then the values, the
    meetings' array (:data:`_SETUP_ASM`), the cluster's row count and ``LEAVES``."""
    value = 8 * sets
    array, count, leaves = value + sets, value + sets + 1, value + sets + 2
    lines = ["{",
             ".reg .pred %tpv_first, %tpv_sender, %tpv_done;",
             ".reg .u32 %tpv_t, %tpv_parity, %tpv_phase, %tpv_bar, %tpv_set, %tpv_to, "
             "%tpv_to_bar, %tpv_bytes;",
             ".reg .b64 %tpv_state;",
             f"and.b32 %tpv_parity, ${count}, 1;",
             f"bfe.u32 %tpv_phase, ${count}, 1, 1;",
             f"mad.lo.u32 %tpv_bar, %tpv_parity, 8, ${array};",
             f"add.u32 %tpv_bar, %tpv_bar, {16 * kind};",
             f"mad.lo.u32 %tpv_set, %tpv_parity, 64, ${array};",
             f"add.u32 %tpv_set, %tpv_set, {32 + 128 * kind};",
             "mov.u32 %tpv_t, %tid.x;",
             "setp.eq.u32 %tpv_first, %tpv_t, 0;",
             f"mul.lo.u32 %tpv_bytes, ${leaves}, {4 * sets};",
             "@%tpv_first mbarrier.arrive.expect_tx.shared::cta.b64 %tpv_state, [%tpv_bar], "
             "%tpv_bytes;",
             f"setp.lt.u32 %tpv_sender, %tpv_t, ${leaves};",
             "mov.u32 %tpv_to, %cluster_ctarank;",
             "mad.lo.u32 %tpv_to, %tpv_to, 4, %tpv_set;",
             "@%tpv_sender mapa.shared::cluster.u32 %tpv_to, %tpv_to, %tpv_t;",
             "@%tpv_sender mapa.shared::cluster.u32 %tpv_to_bar, %tpv_bar, %tpv_t;"]
    for i in range(sets):
        lines.append("@%tpv_sender st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 "
                     f"[%tpv_to+{32 * i}], ${value + i}, [%tpv_to_bar];")
    lines += ["TPV_WAIT:",
              "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 %tpv_done, [%tpv_bar], "
              "%tpv_phase;",
              "@!%tpv_done bra TPV_WAIT;"]
    for i in range(sets):
        for half in (0, 4):
            words = ", ".join(f"${8 * i + half + j}" for j in range(4))
            lines.append(f"ld.shared.v4.b32 {{{words}}}, [%tpv_set+{32 * i + 4 * half}];")
    return "\n".join(lines + ["}"])


_MAX_MEETING = gl.constexpr(_meeting_asm(0, 1))
_SUM_MEETING = gl.constexpr(_meeting_asm(1, 1))
# The statistics' max meeting also carries each leaf's sum of the cluster's previous row, in a
# second set of slots: one meeting a row, and the previous row's sums are in every program's
# shared memory once the next row's maxima are.
_MAX_AND_PREVIOUS_SUMS_MEETING = gl.constexpr(_meeting_asm(0, 2))
_MEETING_OPERANDS = gl.constexpr("=r," * 8 + "r,r,r,r")
_TWO_SETS_MEETING_OPERANDS = gl.constexpr("=r," * 16 + "r,r,r,r,r")


@gluon.jit
def _meetings():
    """The program's meetings' shared array (its address), its mbarriers initialized, once every
    program of the cluster has initialized its own."""
    return gl.inline_asm_elementwise(_SETUP_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _leave_cluster():
    """Wait until every program of the cluster is past its last meeting."""
    return gl.inline_asm_elementwise(_TEARDOWN_ASM, "=r", [], dtype=gl.int32, is_pure=False,
                                     pack=1)


@gluon.jit
def _floats(w, FIRST: gl.constexpr):
    """Words ``FIRST .. FIRST + 7`` of a meeting's output, as the fp32 values they hold."""
    return (w[FIRST].to(gl.float32, bitcast=True), w[FIRST + 1].to(gl.float32, bitcast=True),
            w[FIRST + 2].to(gl.float32, bitcast=True), w[FIRST + 3].to(gl.float32, bitcast=True),
            w[FIRST + 4].to(gl.float32, bitcast=True), w[FIRST + 5].to(gl.float32, bitcast=True),
            w[FIRST + 6].to(gl.float32, bitcast=True), w[FIRST + 7].to(gl.float32, bitcast=True))


@gluon.jit
def _meet(asm: gl.constexpr, value, meetings, count, LEAVES: gl.constexpr):
    """The row's ``LEAVES`` fp32 values (leaf order) once every program of the cluster gave its
    (``count``: the cluster's rows before this one; ``meetings``: :func:`_meetings`)."""
    w = gl.inline_asm_elementwise(asm, _MEETING_OPERANDS,
                                  [value.to(gl.int32, bitcast=True), meetings, count,
                                   LEAVES + count * 0],
                                  dtype=(gl.int32,) * 8, is_pure=False, pack=1)
    return _floats(w, 0)


@gluon.jit
def _meet_with_sums(value, previous_sum, meetings, count, LEAVES: gl.constexpr):
    """``(maxima, previous sums)``: the row's ``LEAVES`` leaf maxima and the leaf sums of the
    cluster's previous row (leaf order), once every program of the cluster gave both."""
    w = gl.inline_asm_elementwise(
        _MAX_AND_PREVIOUS_SUMS_MEETING, _TWO_SETS_MEETING_OPERANDS,
        [value.to(gl.int32, bitcast=True), previous_sum.to(gl.int32, bitcast=True), meetings,
         count, LEAVES + count * 0],
        dtype=(gl.int32,) * 16, is_pure=False, pack=1)
    return _floats(w, 0), _floats(w, 8)


@gluon.jit
def _pair_tree_of(v, LEAVES: gl.constexpr):
    """The adjacent-pair tree over the first ``LEAVES`` values: ``((v0+v1)+(v2+v3))+...``."""
    if LEAVES == 2:
        return v[0] + v[1]
    elif LEAVES == 4:
        return (v[0] + v[1]) + (v[2] + v[3])
    else:
        return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))


@gluon.jit
def _nan_max_of(v, LEAVES: gl.constexpr):
    """The exact max of the first ``LEAVES`` values, ``float("nan")`` if any is NaN."""
    m = v[0]
    nan = v[0] != v[0]
    for i in gl.static_range(1, LEAVES):
        m = gl.maximum(m, v[i])
        nan = nan | (v[i] != v[i])
    return gl.where(nan, float("nan"), m)


@gluon.jit
def _row_of_leaves(a, b, c, row, leaf, meetings, count, x_ptr, y_ptr, max_ptr, total_ptr, n_rows,
                   leaf_len, stride_x, stride_y, lanes, MODE: gl.constexpr, LEAVES: gl.constexpr,
                   STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr, BLOCK: gl.constexpr,
                   TILE: gl.constexpr, LOG2_TILE: gl.constexpr, LIVE: gl.constexpr,
                   PARTIAL: gl.constexpr, HELD: gl.constexpr, lanes_layout: gl.constexpr,
                   fold_layout: gl.constexpr, PREFETCH: gl.constexpr):
    """Leaf ``leaf`` of ``row``, already in ``a, b, c``: its max, the row's max from the
    cluster's, its sum, the row's total from the cluster's sums, and the leaf's output; with
    ``PREFETCH`` the output pass also copies the leaf of the cluster's next row (if any)."""
    row64 = row.to(gl.int64)
    x_leaf = x_ptr + row64 * stride_x + leaf.to(gl.int64) * leaf_len   # for tiles not held
    m_leaf, lo = leaf_extremes(a, b, c, x_leaf, lanes, leaf_len, A, B, BLOCK, TILE, STEPS, LIVE,
                               PARTIAL, HELD, lanes_layout)
    m = _nan_max_of(_meet(_MAX_MEETING, m_leaf, meetings, count, LEAVES), LEAVES)
    shift = shift_of(m)
    _thread_barrier()   # the sum pass reads shared memory again (as in the ticket kernel)
    acc = _sum_lanes(a, b, c, x_leaf, shift, lo, lanes, leaf_len, MODE, STEPS, A, B, BLOCK, TILE,
                     LIVE, PARTIAL, HELD, lanes_layout)
    s_leaf = fold_lanes(acc, TILE, LOG2_TILE, fold_layout)
    total = _pair_tree_of(_meet(_SUM_MEETING, s_leaf, meetings, count, LEAVES), LEAVES)
    if leaf == 0:
        gl.store(max_ptr + row64, m)
        gl.store(total_ptr + row64, total)
    # the output; with PREFETCH each held tile is then copied from the cluster's next row
    next_row = row64 + gl.num_programs(0) // LEAVES
    x_next = x_ptr + next_row * stride_x + leaf.to(gl.int64) * leaf_len
    _write_output(a, b, c, x_leaf, y_ptr + row64 * stride_y + leaf.to(gl.int64) * leaf_len,
                  shift, total, lo, lanes, leaf_len, x_next, next_row < n_rows, MODE, STEPS, A,
                  B, BLOCK, TILE, LIVE, PARTIAL, HELD, lanes_layout, PREFETCH)
    if not PREFETCH:
        # the buffers are copied into again next: every thread is past its last read of them
        _thread_barrier()


@gluon.jit
def _row_total(sums, row, m, total_ptr, lse_ptr, LEAVES: gl.constexpr, LSE: gl.constexpr):
    """Row ``row``'s total from its leaf sums (the pair tree) and, with ``LSE``, its logsumexp
    from its max ``m`` (:func:`~tpinv.kernels.triton_softmax_combine.logsumexp_of`, the combine's own
    function), written by one program of the row's cluster."""
    total = _pair_tree_of(sums, LEAVES)
    gl.store(total_ptr + row, total)
    if LSE:
        gl.store(lse_ptr + row, logsumexp_of(m, total, lse_ptr.dtype.element_ty))


@gluon.jit
def _statistics_of_row(a, b, c, row, leaf, meetings, count, previous_sum, previous_m, x_ptr, max_ptr,
                       total_ptr, lse_ptr, leaf_len, stride_x, lanes, LEAVES: gl.constexpr,
                       STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
                       BLOCK: gl.constexpr, TILE: gl.constexpr, LOG2_TILE: gl.constexpr,
                       LIVE: gl.constexpr, PARTIAL: gl.constexpr, HELD: gl.constexpr,
                       LSE: gl.constexpr, lanes_layout: gl.constexpr,
                       fold_layout: gl.constexpr):
    """The statistics alone, leaf ``leaf`` of ``row``: its max and sum (as
    :func:`_row_of_leaves`), the row meeting once, for the max, which also carries the leaf
    sums of the cluster's previous row (``previous_sum``; its max ``previous_m``): program 0
    takes that row's total then, and nobody waits for a sum.  Returns ``(m, leaf sum)``."""
    row64 = row.to(gl.int64)
    x_leaf = x_ptr + row64 * stride_x + leaf.to(gl.int64) * leaf_len   # for tiles not held
    m_leaf, lo = leaf_extremes(a, b, c, x_leaf, lanes, leaf_len, A, B, BLOCK, TILE, STEPS, LIVE,
                               PARTIAL, HELD, lanes_layout)
    maxima, previous_sums = _meet_with_sums(m_leaf, previous_sum, meetings, count, LEAVES)
    m = _nan_max_of(maxima, LEAVES)
    if (leaf == 0) & (row >= gl.num_programs(0) // LEAVES):   # not the cluster's first row
        _row_total(previous_sums, row64 - gl.num_programs(0) // LEAVES, previous_m, total_ptr,
                   lse_ptr, LEAVES, LSE)
    shift = shift_of(m)
    _thread_barrier()   # the sum pass reads shared memory again (as in the ticket kernel)
    acc = _sum_lanes(a, b, c, x_leaf, shift, lo, lanes, leaf_len, 0, STEPS, A, B, BLOCK, TILE,
                     LIVE, PARTIAL, HELD, lanes_layout)
    s_leaf = fold_lanes(acc, TILE, LOG2_TILE, fold_layout)
    if leaf == 0:
        gl.store(max_ptr + row64, m)
    # the buffers are copied into again next: every thread is past its last read of them
    _thread_barrier()
    return m, s_leaf


@gluon.jit
def _softmax_cluster_kernel(x_ptr, y_ptr, max_ptr, total_ptr, lse_ptr, sync_ptr, n_rows,
                            leaf_len, stride_x, stride_y, stagger_ns, MODE: gl.constexpr,
                            LEAVES: gl.constexpr, LOG2_LEAVES: gl.constexpr, BLOCK: gl.constexpr,
                            TILE: gl.constexpr, LOG2_TILE: gl.constexpr, LIVE: gl.constexpr,
                            PARTIAL: gl.constexpr, HELD: gl.constexpr,
                            STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
                            C_LANES: gl.constexpr, VEC: gl.constexpr,
                            STAGGER: gl.constexpr, fold_layout: gl.constexpr,
                            LSE: gl.constexpr, PREFETCH: gl.constexpr, num_warps: gl.constexpr):
    lanes_layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [num_warps], [0])
    held_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    a = gl.allocate_shared_memory(dtype, [A * BLOCK], held_layout)
    b = gl.allocate_shared_memory(dtype, [B * BLOCK if B > 0 else 16], held_layout)
    c = gl.allocate_shared_memory(dtype, [C_LANES], held_layout)
    lanes = gl.arange(0, TILE, layout=lanes_layout)   # one tile of the row layout
    leaf = gl.program_id(0) % LEAVES                  # this program's rank in its cluster
    row = gl.program_id(0) // LEAVES                  # its cluster's first row
    n_clusters = gl.num_programs(0) // LEAVES
    n_items = n_rows * LEAVES
    if STAGGER > 1:
        _stagger(sync_ptr, stagger_ns, STAGGER)
    _issue(a, b, c, x_ptr, stride_x, leaf_len, row * LEAVES + leaf, n_items, lanes, LEAVES, STEPS,
           A, B, BLOCK, TILE, LIVE, PARTIAL, HELD)
    meetings = _meetings()
    count = gl.to_tensor(0)   # the cluster's rows so far: a meeting's parity and phase
    if MODE == 0:
        previous_sum = gl.to_tensor(0.0)   # nothing before the cluster's first row
        previous_m = gl.to_tensor(0.0)
        while row < n_rows:
            previous_m, previous_sum = _statistics_of_row(
                a, b, c, row, leaf, meetings, count, previous_sum, previous_m, x_ptr, max_ptr,
                total_ptr, lse_ptr, leaf_len, stride_x, lanes, LEAVES, STEPS, A, B, BLOCK, TILE,
                LOG2_TILE, LIVE, PARTIAL, HELD, LSE, lanes_layout, fold_layout)
            row += n_clusters
            count += 1
            _issue(a, b, c, x_ptr, stride_x, leaf_len, row * LEAVES + leaf, n_items, lanes,
                   LEAVES, STEPS, A, B, BLOCK, TILE, LIVE, PARTIAL, HELD)
        if row >= n_clusters:   # the cluster's last row: its sums meet once more
            # the statistics' only meeting on the sums' mbarriers: their first phase (count 0)
            sums = _meet(_SUM_MEETING, previous_sum, meetings, count * 0, LEAVES)
            if leaf == 0:
                _row_total(sums, (row - n_clusters).to(gl.int64), previous_m, total_ptr,
                           lse_ptr, LEAVES, LSE)
    else:
        while row < n_rows:
            _row_of_leaves(a, b, c, row, leaf, meetings, count, x_ptr, y_ptr, max_ptr, total_ptr,
                           n_rows, leaf_len, stride_x, stride_y, lanes, MODE, LEAVES, STEPS, A,
                           B, BLOCK, TILE, LOG2_TILE, LIVE, PARTIAL, HELD, lanes_layout,
                           fold_layout, PREFETCH)
            row += n_clusters
            count += 1
            if not PREFETCH:   # else the output pass copied it
                _issue(a, b, c, x_ptr, stride_x, leaf_len, row * LEAVES + leaf, n_items, lanes,
                       LEAVES, STEPS, A, B, BLOCK, TILE, LIVE, PARTIAL, HELD)
    _leave_cluster()
    if STAGGER > 1:
        _unstagger(sync_ptr)


def softmax_rows_clustered(rows: torch.Tensor, out, max_, total, leaves: int, mode: int,
                           block: int, n_programs: int, num_warps: int, per_sm: float,
                           stagger_ns: int, lse: torch.Tensor | None = None) -> None:
    """:func:`tpinv.kernels.gluon_softmax.softmax_rows_held`'s launch with the row's leaves in one
    cluster (``leaves`` in :data:`CLUSTER_LEAVES`): ``n_programs // leaves`` clusters at most, no
    more than fit the GPU at once and no more than there are rows."""
    if leaves not in CLUSTER_LEAVES:
        raise ValueError(f"a cluster holds a row of {CLUSTER_LEAVES} leaves, not {leaves}")
    n_rows, width = rows.shape
    leaf_len = width // leaves
    target = rows if out is None else out
    # the statistics alone write each row's total, and its logsumexp into lse where given
    options = held_launch_options(rows.element_size(), leaf_len, leaves, mode, block, num_warps,
                                  per_sm, stagger_ns, lse is not None,
                                  (rows.dtype, mode) in PREFETCHED)
    staggered = options["STAGGER"] > 0
    # staggered starts: the arrival count of each SM, left at zero by every launch; else unread
    # (an int32 view of an output: nothing allocated, no counters taken)
    sync = counters(ARRIVAL_SLOTS, rows.device) if staggered else total.view(torch.int32)
    args = (rows, target, max_, total, total if lse is None else lse, sync, n_rows, leaf_len,
            rows.stride(0), target.stride(0), stagger_ns if staggered else 0)
    kernel = clustered(_softmax_cluster_kernel, args, options, leaves)
    kernel.launch(max(1, min(n_rows, n_programs // leaves, kernel.max_clusters)), args)

