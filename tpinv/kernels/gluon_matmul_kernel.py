"""The contract matmul's Hopper (sm_90) kernel in Gluon: persistent and warp-specialized.

Invariant kept: the same bits as :func:`tpinv.kernels.matmul_route.matmul_cuda` /
``matmul_partial_cuda``.  Output element (m, n) is a function of row m of ``x``, row n
of ``w``, the dtype and ``leaves`` only: K is cut into ``leaves`` contiguous leaves;
each leaf is one fp32 wgmma chain over its k range in increasing k, started from a +0
tile with every wgmma accumulating -- the Triton kernel's instruction sequence (k tile
``tiles.block_k(dtype, K / leaves)``); the leaf results are
combined by the adjacent-pair tree ``((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))`` and rounded
once (or returned in fp32).  :mod:`tpinv.kernels.gluon_matmul` checks the inputs, plans
and launches it.

Kernel shape.  One CTA per SM walks output tiles in grouped order.  A producer warp
issues TMA loads of the ``x`` [BM, BK] and ``w`` [BN, BK] k tiles, in increasing k, into
a STAGES-deep shared-memory ring; slot i is guarded by ``ready[i]`` (the TMA bytes have
landed) and ``empty[i]`` (both consumer warpgroups are done reading it).  The consumer
warpgroups (the default partition; one per 64 rows of the tile) issue async wgmma with
one group in flight; once every consumer warp has waited for the wgmma reading a slot (a
partition barrier), one thread arrives on its ``empty`` barrier (count 1).  Ring
position p (counted over the whole kernel, identically by both sides) uses slot
p % STAGES with phase (p // STAGES) & 1: each barrier's phase flips once per wrap.

A tile may be ``BN + BN2`` wide (``GluonConfig.block_n2``): two accumulators side by side,
each fed by its own wgmma on the same x tile, w loaded as two TMA boxes into two rings under
one barrier -- a 96- or 192-wide tile without a non-power-of-two tensor.  Each element's chain
is the same either way.

The leaf loop is unrolled (``LEAVES`` is a compile-time constant), so every tree step
is fixed at compile time: after leaf i the binary counter either parks the value in the
saved level of its lowest 0 bit or, for the last leaf, climbs to the root.  Levels 0
and 1 live in registers; level 2 (needed only for 8 leaves) lives in shared memory.
The producer runs up to STAGES k tiles ahead, across tile boundaries, so the epilogue
of a tile (round, store) overlaps the loads of the next one.  A 16-bit output whose rows are
16-byte aligned leaves through shared memory and a TMA store (``EPI_TMA``): the consumers round
the tile into a shared-memory buffer and one thread issues the store, which drains while the
next tile's wgmmas run (before the buffer is written again, its previous store has been read
out); under an 8-leaf tree the staging tiles are the bytes of the tree's third level (read for the
last time before the epilogue writes them; a tile's leaf 3 writes the level once the previous
tile's store has read them out), which gives the ring one stage more.  An fp32 output is stored
from registers.  Either way each element is the same rounding
of the same fp32 value.  M and N edges: TMA zero-fills loads past the tensor, clips its stores
to the tensor, and the register epilogue masks its stores; padded rows and columns never mix
with real ones.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                             warpgroup_mma, warpgroup_mma_wait)

#: Leaf counts the kernel unrolls (saved tree levels: registers for 1-2, smem for the 3rd).
SUPPORTED_LEAVES = (1, 2, 4, 8)


@gluon.jit
def _tile_offsets(tile, num_pid_m, num_pid_n, BM: gl.constexpr, BN: gl.constexpr,
                  GROUP_M: gl.constexpr):
    """Grouped tile order: GROUP_M row tiles share each w column tile in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % group_rows
    pid_n = (tile % in_group) // group_rows
    return pid_m * BM, pid_n * BN


@gluon.jit
def _producer(x_desc, w_desc, w2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, k_tiles,
              BM: gl.constexpr, BN: gl.constexpr, BN2: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr, X_T: gl.constexpr, W_KN: gl.constexpr):
    """One warp: TMA loads of every k tile of every tile of this CTA, in ring order (a tile
    ``BN + BN2`` wide loads its w rows as two boxes, ``BN`` then ``BN2``)."""
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN + BN2)
    num_tiles = num_pid_m * num_pid_n
    nbytes: gl.constexpr = (x_desc.block_type.nbytes + w_desc.block_type.nbytes
                            + (w2_desc.block_type.nbytes if BN2 > 0 else 0))
    slot = 0
    phase = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, num_pid_m, num_pid_n, BM, BN + BN2, GROUP_M)
        for kt in range(k_tiles):
            # A fresh barrier counts as having completed the phase before phase 0, so
            # the first wrap passes at once; later wraps wait for the consumers' release.
            mbarrier.wait(empty.index(slot), phase ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            if X_T:  # x given as its [K, M] row-major transpose
                tma.async_copy_global_to_shared(x_desc, [kt * BK, off_m], bar, a_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(x_desc, [off_m, kt * BK], bar, a_bufs.index(slot))
            if W_KN:  # w given as its [K, N] row-major transpose
                tma.async_copy_global_to_shared(w_desc, [kt * BK, off_n], bar, b_bufs.index(slot))
                if BN2 > 0:
                    tma.async_copy_global_to_shared(w2_desc, [kt * BK, off_n + BN], bar,
                                                    b2_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(w_desc, [off_n, kt * BK], bar, b_bufs.index(slot))
                if BN2 > 0:
                    tma.async_copy_global_to_shared(w2_desc, [off_n + BN, kt * BK], bar,
                                                    b2_bufs.index(slot))
            slot += 1
            if slot == STAGES:
                slot = 0
                phase ^= 1


@gluon.jit
def _consumer(a_bufs, b_bufs, b2_bufs, ready, empty, s2_buf, t2_buf, c_buf, c2_buf, out_ptr, out_desc,
              out2_desc, M, N, stride_om, tiles_per_leaf, LEAVES: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, BN2: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
              ZERO_ACC: gl.constexpr, X_T: gl.constexpr, W_KN: gl.constexpr,
              EPI_TMA: gl.constexpr, num_warps: gl.constexpr):
    """The consumer warpgroups: the leaf chains, the tree, the epilogue.  A tile ``BN + BN2``
    wide (``BN2 > 0``) keeps two accumulators side by side, columns ``[0, BN)`` and
    ``[BN, BN + BN2)``, each fed by its own wgmma from the same x tile: every element's chain
    is the same k sequence either way."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16])
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN + BN2)
    num_tiles = num_pid_m * num_pid_n
    rows0 = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    cols0 = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    # A leaf's chain reuses the registers of whatever tile just died (the previous leaf's
    # chain, or the previous tile's result), so no extra fp32 tile is ever live.
    acc = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
    if BN2 > 0:
        acc2_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN2, 16])
        rows2 = gl.arange(0, BM, layout=gl.SliceLayout(1, acc2_layout))
        cols2 = gl.arange(0, BN2, layout=gl.SliceLayout(0, acc2_layout))
        acc2 = gl.zeros([BM, BN2], gl.float32, layout=acc2_layout)
    slot = 0
    phase = 0
    prev = STAGES - 1  # the slot read by the previous wgmma
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, num_pid_m, num_pid_n, BM, BN + BN2, GROUP_M)
        for leaf in gl.static_range(LEAVES):
            if ZERO_ACC:
                # +0 in place of the dead tile: an opaque move, so no constant zero tile is
                # hoisted and kept live beside the saved levels
                acc = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [acc], dtype=gl.float32,
                                                is_pure=False, pack=1)
                if BN2 > 0:
                    acc2 = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [acc2],
                                                     dtype=gl.float32, is_pure=False, pack=1)
            for kk in range(tiles_per_leaf):
                mbarrier.wait(ready.index(slot), phase)
                # the leaf's chain starts from zero: a +0 tile, or (kk == 0, scale-d 0) none
                # wgmma reads A as [BM, BK] and B as [BK, BN], either major order
                if X_T:
                    a = a_bufs.index(slot).permute((1, 0))
                else:
                    a = a_bufs.index(slot)
                if W_KN:
                    b = b_bufs.index(slot)
                else:
                    b = b_bufs.index(slot).permute((1, 0))
                acc = warpgroup_mma(a, b, acc, use_acc=(kk > 0) | ZERO_ACC, is_async=True)
                if BN2 > 0:
                    if W_KN:
                        b2 = b2_bufs.index(slot)
                    else:
                        b2 = b2_bufs.index(slot).permute((1, 0))
                    acc2 = warpgroup_mma(a, b2, acc2, use_acc=(kk > 0) | ZERO_ACC, is_async=True)
                    # at most this k tile's two wgmmas in flight: the previous ones are done
                    acc, acc2 = warpgroup_mma_wait(2, deps=(acc, acc2))
                else:
                    # at most this wgmma in flight: the previous one is done with its slot
                    acc = warpgroup_mma_wait(1, deps=(acc, ))
                gl.thread_barrier()  # both warpgroups are past their wait: one thread arrives
                mbarrier.arrive(empty.index(prev), pred=kk > 0)
                prev = slot
                slot += 1
                if slot == STAGES:
                    slot = 0
                    phase ^= 1
            if BN2 > 0:
                acc, acc2 = warpgroup_mma_wait(0, deps=(acc, acc2))
            else:
                acc = warpgroup_mma_wait(0, deps=(acc, ))
            gl.thread_barrier()
            mbarrier.arrive(empty.index(prev))
            # the binary counter after leaf `leaf` (all compile-time); the second
            # accumulator (t*, result2) takes the same steps
            if leaf % 2 == 0:
                if leaf == LEAVES - 1:
                    result = acc
                    if BN2 > 0:
                        result2 = acc2
                else:
                    s0 = acc
                    if BN2 > 0:
                        t0 = acc2
            else:
                v = s0 + acc
                if BN2 > 0:
                    v2 = t0 + acc2
                if leaf % 4 == 1:
                    if leaf == LEAVES - 1:
                        result = v
                        if BN2 > 0:
                            result2 = v2
                    else:
                        s1 = v
                        if BN2 > 0:
                            t1 = v2
                else:
                    v = s1 + v
                    if BN2 > 0:
                        v2 = t1 + v2
                    if leaf % 8 == 3:
                        if leaf == LEAVES - 1:
                            result = v
                            if BN2 > 0:
                                result2 = v2
                        else:
                            if EPI_TMA:
                                # the level's bytes are the staging tiles: the previous tile's
                                # stores have read them out
                                tma.store_wait(0)
                                gl.thread_barrier()
                            s2_buf.store(v)
                            if BN2 > 0:
                                t2_buf.store(v2)
                    else:
                        result = s2_buf.load(acc_layout) + v
                        if BN2 > 0:
                            result2 = t2_buf.load(acc2_layout) + v2
        if EPI_TMA:
            tma.store_wait(0)      # the previous tile's stores have read the buffers out
            gl.thread_barrier()
            c_buf.store(result.to(out_desc.dtype))
            if BN2 > 0:
                c2_buf.store(result2.to(out2_desc.dtype))
            fence_async_shared()
            gl.thread_barrier()    # every consumer thread's part is in shared memory
            tma.async_copy_shared_to_global(out_desc, [off_m, off_n], c_buf)
            if BN2 > 0:
                tma.async_copy_shared_to_global(out2_desc, [off_m, off_n + BN], c2_buf)
        else:
            rows = off_m + rows0
            cols = off_n + cols0
            ptrs = out_ptr + rows[:, None].to(gl.int64) * stride_om + cols[None, :]
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            gl.store(ptrs, result.to(out_ptr.dtype.element_ty), mask=mask)
            if BN2 > 0:
                r2 = off_m + rows2
                c2 = off_n + BN + cols2
                ptrs2 = out_ptr + r2[:, None].to(gl.int64) * stride_om + c2[None, :]
                mask2 = (r2[:, None] < M) & (c2[None, :] < N)
                gl.store(ptrs2, result2.to(out_ptr.dtype.element_ty), mask=mask2)
        acc = result
        if BN2 > 0:
            acc2 = result2
    if EPI_TMA:
        tma.store_wait(0)


@gluon.jit(do_not_specialize=["M", "tiles_per_leaf"])
def _contract_mm_ws_kernel(x_desc, w_desc, w2_desc, out_ptr, out_desc, out2_desc, M, N, stride_om,
                           tiles_per_leaf, LEAVES: gl.constexpr, STAGES: gl.constexpr,
                           GROUP_M: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           ZERO_ACC: gl.constexpr, X_T: gl.constexpr, W_KN: gl.constexpr,
                           BN2: gl.constexpr, EPI_TMA: gl.constexpr, num_warps: gl.constexpr):
    X0: gl.constexpr = x_desc.block_type.shape[0]
    X1: gl.constexpr = x_desc.block_type.shape[1]
    W0: gl.constexpr = w_desc.block_type.shape[0]
    W1: gl.constexpr = w_desc.block_type.shape[1]
    BM: gl.constexpr = X1 if X_T else X0
    BK: gl.constexpr = X0 if X_T else X1
    BN: gl.constexpr = W1 if W_KN else W0
    dtype: gl.constexpr = x_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, X0, X1], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, W0, W1], w_desc.layout)
    # the second accumulator's w rows (a token ring when there is none)
    if BN2 > 0:
        b2_bufs = gl.allocate_shared_memory(
            dtype, [STAGES, w2_desc.block_type.shape[0], w2_desc.block_type.shape[1]],
            w2_desc.layout)
    else:
        b2_bufs = b_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    # the third saved tree level: one fp32 tile per accumulator, only for 8 leaves
    S2_ROWS: gl.constexpr = BM if LEAVES == 8 else 8
    S2_COLS: gl.constexpr = BN if LEAVES == 8 else 8
    s2_buf = gl.allocate_shared_memory(
        gl.float32, [S2_ROWS, S2_COLS],
        gl.NVMMASharedLayout.get_default_for([S2_ROWS, S2_COLS], gl.float32))
    T2_ROWS: gl.constexpr = BM if LEAVES == 8 and BN2 > 0 else 8
    T2_COLS: gl.constexpr = BN2 if LEAVES == 8 and BN2 > 0 else 8
    t2_buf = gl.allocate_shared_memory(
        gl.float32, [T2_ROWS, T2_COLS],
        gl.NVMMASharedLayout.get_default_for([T2_ROWS, T2_COLS], gl.float32))
    # the epilogue's staging tiles (out_desc / out2_desc stand in for x_desc where EPI_TMA is off);
    # under an 8-leaf tree they take the bytes of its third level (fp32, twice their size): the
    # epilogue writes them after the level's last read and a tile's leaf 3 writes the level after
    # the previous tile's store has read them out
    if EPI_TMA and LEAVES == 8:
        c_buf = s2_buf._reinterpret(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
        if BN2 > 0:
            c2_buf = t2_buf._reinterpret(out2_desc.dtype, out2_desc.block_type.shape, out2_desc.layout)
        else:
            c2_buf = c_buf
    elif EPI_TMA:
        c_buf = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
        if BN2 > 0:
            c2_buf = gl.allocate_shared_memory(out2_desc.dtype, out2_desc.block_type.shape,
                                               out2_desc.layout)
        else:
            c2_buf = c_buf
    else:
        c_buf = s2_buf
        c2_buf = s2_buf
    k_tiles = LEAVES * tiles_per_leaf
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, b2_bufs, ready, empty, s2_buf, t2_buf, c_buf, c2_buf, out_ptr,
                     out_desc, out2_desc, M, N, stride_om, tiles_per_leaf, LEAVES, BM, BN, BN2,
                     STAGES, GROUP_M, ZERO_ACC, X_T, W_KN, EPI_TMA, num_warps)),
        (_producer, (x_desc, w_desc, w2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N,
                     k_tiles, BM, BN, BN2, BK, STAGES, GROUP_M, X_T, W_KN)),
    ], [1], [PRODUCER_REGS])
