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
meeting is one write of the leaf's fp32 bits into every program's shared memory (slot ``r``,
the row's parity choosing one of two sets of slots) and one cluster barrier (release, acquire),
after which each program reads the row's values from its own shared memory.  The hardware keeps
a cluster's programs resident together, so no launch order, residency or other kernel can make
a meeting wait forever, and no global counter or memset is needed.  The statistics alone meet
once, for the max: each leaf then writes its sum to the row's slot in global memory and goes on,
and :func:`~tpinv.kernels.gluon_softmax.combine_sums` takes each row's total after the launch,
as it does for the ticket kernel (a second meeting there cost fp32 statistics 9 points of copy
bandwidth: docs/benchmarks.md, "The statistics in a cluster meet once").
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from tpinv.kernels.cluster_launch import clustered
from tpinv.kernels.gluon_softmax import (combine_sums, _issue, _publish, _stagger, _sum_lanes,
                                         _thread_barrier, _write_output)
from tpinv.kernels.gluon_softmax_plan import held_launch_options
from tpinv.kernels.gluon_softmax_leaf import fold_lanes, leaf_extremes, shift_of

__all__ = ["softmax_rows_clustered", "CLUSTER_LEAVES"]

#: Leaves a row may be cut in to meet in one cluster (8: the largest portable cluster).
CLUSTER_LEAVES = (2, 4, 8)

# A meeting, in every thread: the leaf's value into slot [rank] of program (thread index % 8)'s
# set [parity] of sixteen words (eight a parity), its cluster barrier, then the set's eight
# words read from this program's own shared memory.  Each program's threads write every
# program's slot (a cluster of fewer than eight: a program's slot is written more than once,
# always with the same value); the barrier's release and acquire order the writes before
# the reads.  The set of the next row's parity is written only after every program has passed
# this row's barrier, so no value is overwritten before it is read.
_MEETING = """{
.shared .align 16 .b32 %NAME%[16];
.reg .u32 %tpv_base, %tpv_slot, %tpv_t;
mov.u32 %tpv_base, %NAME%;
and.b32 %tpv_t, $9, 1;
mad.lo.u32 %tpv_base, %tpv_t, 32, %tpv_base;
mov.u32 %tpv_t, %cluster_ctarank;
mad.lo.u32 %tpv_slot, %tpv_t, 4, %tpv_base;
mov.u32 %tpv_t, %tid.x;
rem.u32 %tpv_t, %tpv_t, $10;
mapa.shared::cluster.u32 %tpv_slot, %tpv_slot, %tpv_t;
st.shared::cluster.b32 [%tpv_slot], $8;
barrier.cluster.arrive.release.aligned;
barrier.cluster.wait.acquire.aligned;
ld.shared.v4.b32 {$0, $1, $2, $3}, [%tpv_base];
ld.shared.v4.b32 {$4, $5, $6, $7}, [%tpv_base+16];
}"""
_MAX_MEETING = gl.constexpr(_MEETING.replace("%NAME%", "tpinv_row_maxima"))
_SUM_MEETING = gl.constexpr(_MEETING.replace("%NAME%", "tpinv_row_sums"))
_MEETING_OPERANDS = gl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r,r")


@gluon.jit
def _meet(asm: gl.constexpr, value, parity, LEAVES: gl.constexpr):
    """The row's ``LEAVES`` fp32 values (leaf order) once every program of the cluster gave its."""
    w = gl.inline_asm_elementwise(asm, _MEETING_OPERANDS,
                                  [value.to(gl.int32, bitcast=True), parity, LEAVES + parity * 0],
                                  dtype=(gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32,
                                         gl.int32, gl.int32), is_pure=False, pack=1)
    return (w[0].to(gl.float32, bitcast=True), w[1].to(gl.float32, bitcast=True),
            w[2].to(gl.float32, bitcast=True), w[3].to(gl.float32, bitcast=True),
            w[4].to(gl.float32, bitcast=True), w[5].to(gl.float32, bitcast=True),
            w[6].to(gl.float32, bitcast=True), w[7].to(gl.float32, bitcast=True))


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
def _row_of_leaves(a, b, c, row, leaf, parity, x_ptr, y_ptr, max_ptr, total_ptr, slot_ptr,
                   leaf_len, stride_x, stride_y, lanes, MODE: gl.constexpr, LEAVES: gl.constexpr,
                   STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr, BLOCK: gl.constexpr,
                   TILE: gl.constexpr, LOG2_TILE: gl.constexpr, LIVE: gl.constexpr,
                   PARTIAL: gl.constexpr, HELD: gl.constexpr, lanes_layout: gl.constexpr,
                   fold_layout: gl.constexpr):
    """Leaf ``leaf`` of ``row``, already in ``a, b, c``: its max, the row's max from the
    cluster's, its sum, then (statistics alone) the sum into ``slot_ptr``'s row slot, or the row's
    total from the cluster's sums and the leaf's output."""
    row64 = row.to(gl.int64)
    x_leaf = x_ptr + row64 * stride_x + leaf.to(gl.int64) * leaf_len   # for tiles not held
    m_leaf, lo = leaf_extremes(a, b, c, x_leaf, lanes, leaf_len, A, B, BLOCK, TILE, STEPS, LIVE,
                               PARTIAL, HELD, lanes_layout)
    m = _nan_max_of(_meet(_MAX_MEETING, m_leaf, parity, LEAVES), LEAVES)
    shift = shift_of(m)
    _thread_barrier()   # the sum pass reads shared memory again (as in the ticket kernel)
    acc = _sum_lanes(a, b, c, x_leaf, shift, lo, lanes, leaf_len, MODE, STEPS, A, B, BLOCK, TILE,
                     LIVE, PARTIAL, HELD, lanes_layout)
    s_leaf = fold_lanes(acc, TILE, LOG2_TILE, fold_layout)
    if MODE == 0:
        # the statistics alone: the leaf sum goes to the row's slot, nobody waits for it, and
        # combine_sums takes the row's total after the launch (as the ticket kernel's does)
        _publish(slot_ptr + row64 * (2 * LEAVES) + LEAVES + leaf, s_leaf)
        if leaf == 0:
            gl.store(max_ptr + row64, m)
    else:
        total = _pair_tree_of(_meet(_SUM_MEETING, s_leaf, parity, LEAVES), LEAVES)
        if leaf == 0:
            gl.store(max_ptr + row64, m)
            gl.store(total_ptr + row64, total)
        _write_output(a, b, c, x_leaf, y_ptr + row64 * stride_y + leaf.to(gl.int64) * leaf_len,
                      shift, total, lo, lanes, leaf_len, MODE, STEPS, A, B, BLOCK, TILE, LIVE,
                      PARTIAL, HELD, lanes_layout)
    # the buffers are copied into again next: every thread is past its last read of them
    _thread_barrier()


@gluon.jit
def _softmax_cluster_kernel(x_ptr, y_ptr, max_ptr, total_ptr, slot_ptr, sync_ptr, n_rows,
                            leaf_len, stride_x, stride_y, stagger_ns, MODE: gl.constexpr,
                            LEAVES: gl.constexpr, LOG2_LEAVES: gl.constexpr, BLOCK: gl.constexpr,
                            TILE: gl.constexpr, LOG2_TILE: gl.constexpr, LIVE: gl.constexpr,
                            PARTIAL: gl.constexpr, HELD: gl.constexpr,
                            STEPS: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
                            C_LANES: gl.constexpr, VEC: gl.constexpr,
                            STAGGER: gl.constexpr, fold_layout: gl.constexpr,
                            num_warps: gl.constexpr):
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
    parity = 0
    while row < n_rows:
        async_copy.wait_group(0)
        _thread_barrier()
        _row_of_leaves(a, b, c, row, leaf, parity, x_ptr, y_ptr, max_ptr, total_ptr, slot_ptr,
                       leaf_len, stride_x, stride_y, lanes, MODE, LEAVES, STEPS, A, B, BLOCK, TILE,
                       LOG2_TILE, LIVE, PARTIAL, HELD, lanes_layout, fold_layout)
        row += n_clusters
        parity = 1 - parity
        _issue(a, b, c, x_ptr, stride_x, leaf_len, row * LEAVES + leaf, n_items, lanes, LEAVES,
               STEPS, A, B, BLOCK, TILE, LIVE, PARTIAL, HELD)


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
    options = held_launch_options(rows.element_size(), leaf_len, leaves, mode, block, num_warps,
                                  per_sm, stagger_ns)
    staggered = options["STAGGER"] > 0
    # staggered starts: an arrival count per SM (int32, zero before the launch); else unread
    sync = (torch.zeros(1024, dtype=torch.int32, device=rows.device) if staggered
            else torch.empty(1, dtype=torch.int32, device=rows.device))
    # the statistics alone: each leaf's sum, in the ticket kernel's slot layout (every slot read
    # by combine_sums is written first, so nothing is zeroed); else unread
    slots = torch.empty(n_rows * 2 * leaves if mode == 0 else 1, dtype=torch.int64,
                        device=rows.device)
    args = (rows, target, max_, total, slots, sync, n_rows, leaf_len, rows.stride(0),
            target.stride(0), stagger_ns if staggered else 0)
    kernel = clustered(_softmax_cluster_kernel, args, options, leaves)
    kernel.launch(max(1, min(n_rows, n_programs // leaves, kernel.max_clusters)), args, options)
    if mode == 0:
        combine_sums(slots, max_, total, leaves, lse)
