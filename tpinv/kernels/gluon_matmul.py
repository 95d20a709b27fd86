"""The contract matmul on Hopper (sm_90) in Gluon: persistent and warp-specialized.

Invariant kept: the same bits as :func:`tpinv.kernels.triton_matmul.matmul_cuda` /
``matmul_partial_cuda``.  Output element (m, n) is a function of row m of ``x``, row n
of ``w``, the dtype and ``leaves`` only: K is cut into ``leaves`` contiguous leaves;
each leaf is one fp32 wgmma chain over its k range in increasing k, started from a +0
tile with every wgmma accumulating -- the Triton kernel's instruction sequence (k tile
``tiles.block_k(dtype, K / leaves)``); the leaf results are
combined by the adjacent-pair tree ``((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))`` and rounded
once (or returned in fp32).

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
out); an fp32 output is stored from registers.  Either way each element is the same rounding
of the same fp32 value.  M and N edges: TMA zero-fills loads past the tensor, clips its stores
to the tensor, and the register epilogue masks its stores; padded rows and columns never mix
with real ones.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                             warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tpinv.kernels.launch import (cdiv, is_bound, launch_with, operands_key, remember, reused_descriptor,
                                  sm_count)
from tpinv.kernels.tiles import GluonConfig, block_k, check_gluon_config, gluon_launch_config

#: Leaf counts the kernel unrolls (saved tree levels: registers for 1-2, smem for the 3rd).
SUPPORTED_LEAVES = (1, 2, 4, 8)
_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


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
    # the epilogue's staging tiles (out_desc / out2_desc stand in for x_desc where EPI_TMA is off)
    if EPI_TMA:
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


def unsupported_reason(x, w, leaves: int, out_dtype) -> str | None:
    """Why this kernel cannot run (x, w, leaves, out_dtype), or None when it can."""
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return "x and w must be torch tensors"
    if not (x.is_cuda and w.is_cuda) or x.device != w.device:
        return f"x and w must be on one CUDA device, got {x.device} and {w.device}"
    if _capability(x.device) != (9, 0):
        return f"needs an sm_90 GPU (wgmma), got capability {_capability(x.device)}"
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        return f"x and w must both be bf16 or fp16, got {x.dtype} and {w.dtype}"
    if out_dtype not in (None, x.dtype, torch.float32):
        return f"out_dtype must be None, {x.dtype} or torch.float32, got {out_dtype}"
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        return (f"expected 2-D x [M, K] and w [N, K] with the same K; got x {tuple(x.shape)}, "
                f"w {tuple(w.shape)}")
    if not isinstance(leaves, int) or leaves not in SUPPORTED_LEAVES:
        return f"leaves must be one of {SUPPORTED_LEAVES}, got {leaves!r}"
    m, k = x.shape
    if m == 0 or w.shape[0] == 0 or k == 0:
        return f"empty operands (M={m}, N={w.shape[0]}, K={k})"
    if k % leaves:
        return f"K={k} is not divisible by leaves={leaves}"
    leaf_len = k // leaves
    if leaf_len % block_k(x.dtype, leaf_len):
        return (f"leaf length K/leaves={leaf_len} is not a multiple of its k tile "
                f"{block_k(x.dtype, leaf_len)} (the Triton kernel zero-pads such leaves)")
    for name, t in (("x", x), ("w", w)):
        if _major(t) is None:
            return (f"{name} must be row-major or column-major (unit-stride rows or the transpose of such) "
                    f"with 16-byte aligned rows, got shape {tuple(t.shape)} strides {t.stride()}")
        if t.data_ptr() % 16:
            return f"{name} must be 16-byte aligned for TMA"
    return None


def _major(t: torch.Tensor) -> str | None:
    """"row" ([R, K] rows of unit stride, as a contiguous tensor or a column slice of one), "col"
    (the transpose of such a [K, R]) or None; the outer stride must be 16-byte aligned for a TMA
    descriptor (which carries the strides: a slice reads only its own columns)."""
    rows, cols = t.shape
    if t.stride(1) == 1 and t.stride(0) >= cols and (t.stride(0) * t.element_size()) % 16 == 0:
        return "row"
    if t.stride(0) == 1 and t.stride(1) >= rows and (t.stride(1) * t.element_size()) % 16 == 0:
        return "col"
    return None


def supported(x: torch.Tensor, w: torch.Tensor, leaves: int) -> bool:
    """True when :func:`gluon_matmul_cuda` can run ``x @ w.T`` with ``leaves`` leaves."""
    return unsupported_reason(x, w, leaves, None) is None


def gluon_matmul_cuda(x: torch.Tensor, w: torch.Tensor, leaves: int,
                      out_dtype: torch.dtype | None = None, *,
                      config: GluonConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` by the contract (bits of ``matmul_cuda`` / ``matmul_partial_cuda``).

    x [M, K] and w [N, K] bf16/fp16 on an sm_90 GPU, each row-major or the transpose of a
    row-major tensor (the gradients' layouts); ``out_dtype`` None rounds
    once to ``x.dtype``, ``torch.float32`` returns the unrounded tree.  Raises ValueError
    naming what is unsupported (see :func:`supported`).
    """
    why = unsupported_reason(x, w, leaves, out_dtype)
    if why is not None:
        raise ValueError(f"gluon_matmul_cuda: {why}")
    out_dtype = out_dtype or x.dtype
    return launch_plan(x, w, leaves, out_dtype, plan_for(x, w, leaves, out_dtype, config))


def plan_for(x: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype,
             config: GluonConfig | None = None, *, operands: tuple | None = None) -> tuple:
    """The launch plan of inputs :func:`unsupported_reason` has passed, made once per shape,
    strides, dtypes, alignment, leaves and config (:func:`launch_plan` runs it).  The dispatch
    in :mod:`tpinv.kernels.triton_matmul` keeps it per call shape: a repeated shape looks up
    one plan."""
    cfg = config or table_config(x, w, leaves)
    key = (operands or operands_key(x, w), leaves, out_dtype, cfg)
    plan = _PLANS.get(key)
    if plan is None:
        plan = remember(_PLANS, key, _plan(x, w, leaves, out_dtype, cfg))
    return plan


def uses_tma_store(x: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype | None = None,
                   config: GluonConfig | None = None) -> bool:
    """Whether :func:`gluon_matmul_cuda` with these arguments stores its output through shared
    memory and TMA (a 16-bit output with 16-byte aligned rows) rather than from registers."""
    return plan_for(x, w, leaves, out_dtype or x.dtype, config)[8]["kw"]["EPI_TMA"]


def table_config(x: torch.Tensor, w: torch.Tensor, leaves: int) -> GluonConfig:
    """The tile table's launch shape for ``x @ w.T`` on ``x``'s device (a speed choice only)."""
    return gluon_launch_config(x.shape[0], w.shape[0], leaves, sm_count(x.device))


def launch_plan(x: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype, plan: tuple) -> torch.Tensor:
    """Descriptors and launch for checked inputs and their plan (:func:`plan_for`): once the plan's
    launch is bound, descriptors are reused per address (:func:`~tpinv.kernels.launch.reused_descriptor`)."""
    m, k = x.shape
    n = w.shape[0]
    (x_t, w_kn, x_block, w_block, w2_block, out_block, out2_block, grid, consts, bound, x_descs, w_descs,
     w2_descs, out_descs, out2_descs) = plan
    out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    reuse = is_bound(bound)
    x_desc = reused_descriptor(x_descs if reuse else None, x,
                               lambda: TensorDescriptor.from_tensor(x.t() if x_t else x, *x_block))
    w_desc = reused_descriptor(w_descs if reuse else None, w,
                               lambda: TensorDescriptor.from_tensor(w.t() if w_kn else w, *w_block))
    w2_desc = w_desc if w2_block is None else reused_descriptor(
        w2_descs if reuse else None, w, lambda: TensorDescriptor.from_tensor(w.t() if w_kn else w, *w2_block))
    out_desc = out2_desc = x_desc   # stand-ins where the epilogue stores from registers
    if out_block is not None:
        out_desc = reused_descriptor(out_descs if reuse else None, out,
                                     lambda: TensorDescriptor.from_tensor(out, *out_block))
        if out2_block is not None:
            out2_desc = reused_descriptor(out2_descs if reuse else None, out,
                                          lambda: TensorDescriptor.from_tensor(out, *out2_block))
    launch_with(_contract_mm_ws_kernel, grid,
                (x_desc, w_desc, w2_desc, out, out_desc, out2_desc, m, n, out.stride(0),
                 k // leaves // consts["BK"]),
                consts["kw"], bound)
    return out


_PLANS: dict = {}


def _plan(x, w, leaves: int, out_dtype: torch.dtype, cfg: GluonConfig) -> tuple:
    """Tile layouts, persistent grid and constexprs of a launch: one per shape, strides, dtype,
    alignment, leaves, output dtype and config (none of it changes an addition)."""
    m, k = x.shape
    n = w.shape[0]
    leaf_len = k // leaves
    bk = block_k(x.dtype, leaf_len)
    check_gluon_config(cfg, leaves, bk)
    gdt = _DTYPES[x.dtype]
    x_t, w_kn = _major(x) == "col", _major(w) == "col"
    x_block = [bk, cfg.block_m] if x_t else [cfg.block_m, bk]
    w_block = [bk, cfg.block_n] if w_kn else [cfg.block_n, bk]
    w2_block = None
    if cfg.block_n2:
        w2_block = [bk, cfg.block_n2] if w_kn else [cfg.block_n2, bk]
        w2_block = (w2_block, _layout(w2_block, gdt))
    # the TMA store epilogue: a 16-bit output (the [m, n] tensor launch_plan allocates) whose rows
    # are 16-byte aligned
    out_block = out2_block = None
    epi_tma = out_dtype in _DTYPES and (n * 2) % 16 == 0
    if epi_tma:
        out_block = ([cfg.block_m, cfg.block_n], _layout([cfg.block_m, cfg.block_n], _DTYPES[out_dtype]))
        if cfg.block_n2:
            out2_block = ([cfg.block_m, cfg.block_n2], _layout([cfg.block_m, cfg.block_n2], _DTYPES[out_dtype]))
    # a config's stages are those that fit beside the staging tile; an epilogue from registers
    # gives the staging tile's bytes back to the ring (the fp32 partials of the leaf-by-leaf route)
    stages = cfg.num_stages
    if not epi_tma:
        stages += (cfg.block_m * cfg.tile_n * 2) // ((cfg.block_m + cfg.tile_n) * bk * 2)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.tile_n)
    grid = (min(sm_count(x.device), tiles), )
    kw = dict(LEAVES=leaves, STAGES=stages, GROUP_M=cfg.group_m,
              PRODUCER_REGS=cfg.producer_regs, ZERO_ACC=cfg.zero_acc, X_T=x_t, W_KN=w_kn,
              BN2=cfg.block_n2, EPI_TMA=epi_tma, num_warps=cfg.num_warps)
    return (x_t, w_kn, (x_block, _layout(x_block, gdt)), (w_block, _layout(w_block, gdt)), w2_block,
            out_block, out2_block, grid, {"BK": bk, "kw": kw}, {}, {}, {}, {}, {}, {})


_LAYOUTS: dict = {}
_CAPABILITY: dict = {}


def _capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def _layout(block: list[int], gdt):
    """The shared-memory layout of a TMA tile of ``block`` (swizzled for wgmma)."""
    key = (tuple(block), gdt)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(block, gdt)
    return _LAYOUTS[key]
