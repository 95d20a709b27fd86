"""Decode attention by chunks in parallel on Hopper (sm_90), warp-specialized in Gluon: same bits.

The same launch shape as :mod:`tpinv.kernels.triton_attention_split` -- one program per (chunk,
batch row x kv head), each writing its chunk's state, the pair's last program to count in
merging them in chunk order -- with a program's 8 key blocks spread over three warpgroups:

* two softmax warpgroups, one for the even and one for the odd blocks of the chunk.  Each
  computes ``s_j = dot(q, k_j^T) * scale`` and ``max_j = rowmax(s_j)`` on its own, takes
  ``m_{j-1}`` from the other through shared memory, hands on ``m_j = max(m_{j-1}, max_j)``,
  then writes ``alpha_j``, ``p_j`` (rounded to the input dtype) and ``rowsum(p_j)`` to shared
  memory;
* one accumulator warpgroup runs ``l_j = l_{j-1} * alpha_j + rowsum(p_j)`` and
  ``acc_j = dot(p_j, v_j, acc_{j-1} * alpha_j)`` in block order, then writes the chunk state
  and, in the last program of its pair, merges the states.

Every value is the forward's (``forward_block``, ``merge_state``, ``finish_rows`` of
:mod:`tpinv.kernels.triton_attention`): the same operations on the same operands in the same
order, the scores and probabilities in the same 64-row wgmma layout (so the same row
reductions), no fused multiply-add.  The handover of ``m`` changes who computes a value,
never the value.  So ``out`` and ``lse`` are bit-identical to the one-program forward; only
the time differs, and which launch a call takes is a speed choice
(:func:`tpinv.kernels.triton_attention_split.decode_kernel_for`).  The key and value tiles
are masked copies (zeros past ``T`` and the head dim, as the forward's loads); a block some
row sees only in part gets the forward's visibility mask, its value slots no row sees zeroed
and the rows that see a non-finite value poisoned, as ``clean_kv`` / ``poison_rows`` do.
Scope (:func:`unsupported_reason`): 16-bit inputs, head dim a multiple of 16 up to 128, no
window, no mask, every query row of a kv head in one 64-row tile.
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from tpinv.kernels.device import gluon_device_reason
from tpinv.kernels.launch import launch

__all__ = ["unsupported_reason", "decode_forward_cuda", "BLOCK_M", "MAX_DP"]

#: Rows of the tile (the forward's 64-row wgmma tile) and the largest padded head dim (shared memory).
BLOCK_M, MAX_DP = 64, 128
_ROWS = gl.constexpr(BLOCK_M)
#: Value tiles in flight; registers of the odd-softmax and accumulator warpgroups (speed only).
_V_STAGES, _REGS_SOFTMAX, _REGS_ACC = gl.constexpr(3), gl.constexpr(160), gl.constexpr(192)


@gluon.jit
def _rows(qpos_ptr, b, s_pb, s_ps, S, G: gl.constexpr, ROWS: gl.constexpr, layout: gl.constexpr):
    """Rows ``r = s * G + hg`` of the tile: ``(r, valid, pos)``."""
    rows = gl.arange(0, ROWS, layout=layout)
    valid = rows < S * G
    pos = gl.load(qpos_ptr + b * s_pb + (rows // G).to(gl.int64) * s_ps, mask=valid, other=0)
    return rows, valid, pos


@gluon.jit
def _key_range(pos, valid, T, CAUSAL: gl.constexpr, KB: gl.constexpr):
    """``block_ranges`` without window or mask: ``(hi, f_hi, pmax)``, blocks ``[0, hi)`` some row
    sees, ``[0, f_hi)`` every row sees whole."""
    pmin = gl.min(gl.where(valid, pos, 1 << 62), 0)
    pmax = gl.max(gl.where(valid, pos, -(1 << 62)), 0)
    hi_slot = pmax * 0 + T
    full_hi = pmax * 0 + T
    if CAUSAL:
        hi_slot = gl.minimum(hi_slot, pmax + 1)
        full_hi = gl.minimum(full_hi, pmin + 1)
    hi = gl.where(hi_slot > 0, (hi_slot + KB - 1) // KB, 0)
    f_hi = gl.minimum(gl.maximum(full_hi, 0) // KB, hi)
    return hi.to(gl.int32), f_hi.to(gl.int32), pmax


@gluon.jit
def _program(qpos_ptr, s_pb, s_ps, S, T, Hkv, G: gl.constexpr, CAUSAL: gl.constexpr,
             KB: gl.constexpr, CB: gl.constexpr, row_l: gl.constexpr):
    """This program's chunk ``c`` and pair ``bh = b * Hkv + hk``, its rows, and the chunk's blocks
    some row sees, ``[b0, b0 + n)``: ``(c, bh, b, hk, rows, valid, pos, b0, n, f_hi, pmax)``."""
    c = gl.program_id(0)
    bh = gl.program_id(1)
    b = (bh // Hkv).to(gl.int64)
    hk = (bh % Hkv).to(gl.int64)
    rows, valid, pos = _rows(qpos_ptr, b, s_pb, s_ps, S, G, _ROWS, row_l)
    hi, f_hi, pmax = _key_range(pos, valid, T, CAUSAL, KB)
    b0 = c * CB
    return c, bh, b, hk, rows, valid, pos, b0, gl.minimum(b0 + CB, hi) - b0, f_hi, pmax


@gluon.jit
def _copy_tile(ring, slot, base, s_t, blk, T, D, KB: gl.constexpr, DP: gl.constexpr,
               ld: gl.constexpr):
    """Start copying key/value block ``blk`` into ``ring[slot]`` (zeros past ``T`` and ``D``)."""
    r = blk * KB + gl.arange(0, KB, layout=gl.SliceLayout(1, ld))
    d = gl.arange(0, DP, layout=gl.SliceLayout(0, ld))
    ptrs = base + r.to(gl.int64)[:, None] * s_t + d[None, :]
    async_copy.async_copy_global_to_shared(ring.index(slot), ptrs, (r < T)[:, None] & (d < D)[None, :])


@gluon.jit
def _softmax_wg(PARITY: gl.constexpr, q_ptr, k_ptr, qpos_ptr, q_smem, k_ring, p_buf, a_buf, r_buf,
                m_buf, m_ready, p_ready, s_qb, s_qh, s_qs, s_kb, s_kh, s_kt, s_pb, s_ps, S, T, D,
                Hkv, scale, G: gl.constexpr, CAUSAL: gl.constexpr, KB: gl.constexpr,
                DP: gl.constexpr, CB: gl.constexpr):
    """Blocks ``PARITY, PARITY + 2, ...`` of the chunk: scores, ``m`` handed on, ``alpha``, ``p``, row sums."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KB, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [256 // DP, DP // 8], [4, 1], [1, 0])
    c, bh, b, hk, rows, valid, pos, b0, n, f_hi, pmax = _program(qpos_ptr, s_pb, s_ps, S, T, Hkv, G,
                                                                   CAUSAL, KB, CB, row_l)
    if n > PARITY:
        qr = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, ld))
        qd = gl.arange(0, DP, layout=gl.SliceLayout(0, ld))
        head = hk * G + (qr % G)
        q = gl.load((q_ptr + b * s_qb + head * s_qh + (qr // G).to(gl.int64) * s_qs)[:, None]
                    + qd[None, :], mask=(qr < S * G)[:, None] & (qd < D)[None, :], other=0.0)
        q_smem.store(q)
        k_base = k_ptr + b * s_kb + hk * s_kh
        mine = (n - PARITY + 1) // 2
        for i in gl.static_range(2):
            if i < mine:
                _copy_tile(k_ring, i, k_base, s_kt, b0 + PARITY + 2 * i, T, D, KB, DP, ld)
            async_copy.commit_group()
        fence_async_shared()  # q's generic store, before the dots read it
        zero = gl.zeros([_ROWS, KB], gl.float32, layout=s_layout)
        for i in range(mine):
            j = PARITY + 2 * i
            blk = b0 + j
            async_copy.wait_group(1)
            gl.thread_barrier()
            s = warpgroup_mma(q_smem, k_ring.index(i % 2).permute((1, 0)), zero, use_acc=False)
            s = s * scale
            if i + 2 < mine:
                gl.thread_barrier()  # every warp is past the dot that read this slot
                _copy_tile(k_ring, i % 2, k_base, s_kt, blk + 4, T, D, KB, DP, ld)
            async_copy.commit_group()
            if blk >= f_hi:  # a block some row sees only in part: the forward's visibility
                slots = (blk * KB + gl.arange(0, KB, layout=gl.SliceLayout(0, s_layout))).to(gl.int64)
                vis = valid[:, None] & (slots[None, :] < T)
                if CAUSAL:
                    vis = vis & (slots[None, :] <= pos[:, None])
                s = gl.where(vis, s, float("-inf"))
            rmax = gl.max(s, 1)
            m_prev = gl.full([_ROWS], float("-inf"), gl.float32, layout=row_l)
            if j > 0:
                mbarrier.wait(m_ready.index(j - 1), 0)
                m_prev = m_buf.index(j - 1).load(row_l)
            m_new = gl.maximum(m_prev, rmax)
            m_buf.index(j).store(m_new)
            gl.thread_barrier()
            mbarrier.arrive(m_ready.index(j))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.where(m_new == m_prev, 1.0, gl.exp(m_prev - m_safe))
            p = gl.exp(s - m_safe[:, None])
            p_buf.index(j).store(p.to(k_ring.dtype))
            a_buf.index(j).store(alpha)
            r_buf.index(j).store(gl.sum(p, 1))
            fence_async_shared()  # p's generic store, before the accumulator's dot reads it
            gl.thread_barrier()
            mbarrier.arrive(p_ready.index(j))


@gluon.jit
def _merge(qpos_ptr, acc_st_ptr, ml_st_ptr, out_ptr, lse_ptr, bh, b, hk, s_pb, s_ps, s_ob, s_oh,
           s_os, s_lb, s_lh, S, T, n_chunk, D, G: gl.constexpr, CAUSAL: gl.constexpr,
           KB: gl.constexpr, DP: gl.constexpr, CB: gl.constexpr, ROWS: gl.constexpr,
           GROUP: gl.constexpr):
    """``merge_chunk_states`` and ``finish_rows``: the pair's chunk states in chunk order."""
    mg: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    rl: gl.constexpr = gl.SliceLayout(1, mg)
    rows, valid, pos = _rows(qpos_ptr, b, s_pb, s_ps, S, G, ROWS, rl)
    hi, f_hi, pmax = _key_range(pos, valid, T, CAUSAL, KB)
    c_hi = (hi + CB - 1) // CB
    offs_d = gl.arange(0, DP, layout=gl.SliceLayout(0, mg))
    acc = gl.zeros([ROWS, DP], gl.float32, layout=mg)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rl)
    l_i = gl.zeros([ROWS], gl.float32, layout=rl)
    for g0 in range(0, c_hi, GROUP):
        for jj in gl.static_range(GROUP):  # loads of a group issued together; merged in order
            cc = g0 + jj
            ok = valid & (rows * 0 + cc < c_hi)
            at = (bh.to(gl.int64) * n_chunk + cc) * ROWS + rows
            # volatile: the states were written by other programs of this launch
            acc_c = gl.load(acc_st_ptr + at[:, None] * DP + offs_d[None, :], mask=ok[:, None],
                            other=0.0, volatile=True)
            m_c = gl.load(ml_st_ptr + at * 2, mask=ok, other=float("-inf"), volatile=True)
            l_c = gl.load(ml_st_ptr + at * 2 + 1, mask=ok, other=0.0, volatile=True)
            if cc < c_hi:
                m_new = gl.maximum(m_i, m_c)
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                fa = gl.where(m_new == m_i, 1.0, gl.exp(m_i - m_safe))
                fb = gl.where(m_new == m_c, 1.0, gl.exp(m_c - m_safe))
                acc = acc * fa[:, None] + acc_c * fb[:, None]
                l_i = l_i * fa + l_c * fb
                m_i = m_new
    seen = l_i != 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    inv = gl.div_rn(gl.full([ROWS], 1.0, gl.float32, layout=rl), l_safe)
    res = gl.where(seen[:, None], acc * inv[:, None], 0.0) + 0.0
    lse = gl.where(seen, m_i + gl.log(l_safe), float("-inf"))
    head = hk * G + (rows % G)
    s64 = (rows // G).to(gl.int64)
    gl.store((out_ptr + b * s_ob + head * s_oh + s64 * s_os)[:, None] + offs_d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_d < D)[None, :])
    gl.store(lse_ptr + b * s_lb + head * s_lh + s64, lse, mask=valid)


@gluon.jit
def _accumulator_wg(v_ptr, qpos_ptr, acc_st_ptr, ml_st_ptr, count_ptr, out_ptr, lse_ptr, v_ring,
                    p_buf, a_buf, r_buf, m_buf, p_ready, s_vb, s_vh, s_vt, s_pb, s_ps, s_ob, s_oh,
                    s_os, s_lb, s_lh, S, T, D, Hkv, n_chunk, G: gl.constexpr,
                    CAUSAL: gl.constexpr, KB: gl.constexpr, DP: gl.constexpr, CB: gl.constexpr,
                    ROWS: gl.constexpr, GROUP: gl.constexpr):
    """``l`` and ``acc`` in block order; the chunk state; the merge in the pair's last program."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, DP, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [256 // DP, DP // 8], [4, 1], [1, 0])
    c, bh, b, hk, rows, valid, pos, b0, n, f_hi, pmax = _program(qpos_ptr, s_pb, s_ps, S, T, Hkv, G,
                                                                   CAUSAL, KB, CB, row_l)
    if n > 0:
        v_base = v_ptr + b * s_vb + hk * s_vh
        for i in gl.static_range(_V_STAGES - 1):
            if i < n:
                _copy_tile(v_ring, i, v_base, s_vt, b0 + i, T, D, KB, DP, ld)
            async_copy.commit_group()
        acc = gl.zeros([_ROWS, DP], gl.float32, layout=acc_layout)
        l_i = gl.zeros([_ROWS], gl.float32, layout=row_l)
        for j in range(n):
            async_copy.wait_group(_V_STAGES - 2)
            blk = b0 + j
            vs = j % _V_STAGES
            masked = blk >= f_hi
            first_bad = gl.full([DP], 1 << 30, gl.int32, layout=gl.SliceLayout(0, ld))
            gl.thread_barrier()
            if masked:  # clean_kv: zero the slots no row sees, and non-finite values
                vt = v_ring.index(vs).load(ld)
                slots = blk * KB + gl.arange(0, KB, layout=gl.SliceLayout(1, ld))
                seen = slots < T
                if CAUSAL:
                    seen = seen & (slots.to(gl.int64) <= pmax)
                nonfinite = (vt != vt) | (gl.abs(vt) == float("inf"))
                first_bad = gl.min(gl.where(seen[:, None] & nonfinite, slots[:, None], 1 << 30), 0)
                vt = gl.where(nonfinite, gl.zeros_like(vt), gl.where(seen[:, None], vt, gl.zeros_like(vt)))
                gl.thread_barrier()
                v_ring.index(vs).store(vt)
                fence_async_shared()
                gl.thread_barrier()
            mbarrier.wait(p_ready.index(j), 0)
            alpha = a_buf.index(j).load(row_l)
            l_i = l_i * alpha + r_buf.index(j).load(row_l)
            acc = warpgroup_mma(p_buf.index(j), v_ring.index(vs), acc * alpha[:, None])
            if masked:  # poison_rows: NaN where a row sees a non-finite value (visibility is a prefix)
                bad_from = gl.convert_layout(first_bad, gl.SliceLayout(0, acc_layout))
                lim = pos * 0 + T
                if CAUSAL:
                    lim = gl.minimum(lim, pos + 1)
                acc = gl.where(valid[:, None] & (bad_from[None, :] < lim[:, None]), float("nan"), acc)
            if j + _V_STAGES - 1 < n:
                _copy_tile(v_ring, (j + _V_STAGES - 1) % _V_STAGES, v_base, s_vt, blk + _V_STAGES - 1,
                           T, D, KB, DP, ld)
            async_copy.commit_group()
        offs_d = gl.arange(0, DP, layout=gl.SliceLayout(0, acc_layout))
        keep = rows < S * G
        at = (bh.to(gl.int64) * n_chunk + c) * ROWS + rows
        gl.store(acc_st_ptr + at[:, None] * DP + offs_d[None, :], acc,
                 mask=keep[:, None] & (offs_d < DP)[None, :])
        gl.store(ml_st_ptr + at * 2, m_buf.index(n - 1).load(row_l), mask=keep)
        gl.store(ml_st_ptr + at * 2 + 1, l_i, mask=keep)
    # the pair's last program to count in merges (acquire/release, GPU scope; nobody waits)
    gl.thread_barrier()
    seen_n = gl.atomic_add(count_ptr + bh, 1, sem="acq_rel", scope="gpu") + 1
    if seen_n == gl.num_programs(0):
        gl.thread_barrier()
        _merge(qpos_ptr, acc_st_ptr, ml_st_ptr, out_ptr, lse_ptr, bh, b, hk, s_pb, s_ps, s_ob,
               s_oh, s_os, s_lb, s_lh, S, T, n_chunk, D, G, CAUSAL, KB, DP, CB, ROWS, GROUP)
        gl.store(count_ptr + bh, 0)  # all counted in: at zero for the next launch


@gluon.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, qpos_ptr, acc_st_ptr, ml_st_ptr, count_ptr, out_ptr, lse_ptr,
                   s_qb, s_qh, s_qs, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_pb, s_ps, s_ob, s_oh,
                   s_os, s_lb, s_lh, S, T, D, Hkv, n_chunk, scale, G: gl.constexpr,
                   CAUSAL: gl.constexpr, KB: gl.constexpr, DP: gl.constexpr, CB: gl.constexpr,
                   ROWS: gl.constexpr, GROUP: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, DP], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KB, DP], dtype)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_even = gl.allocate_shared_memory(dtype, [_ROWS, DP], q_layout)
    q_odd = gl.allocate_shared_memory(dtype, [_ROWS, DP], q_layout)
    k_even = gl.allocate_shared_memory(dtype, [2, KB, DP], kv_layout)
    k_odd = gl.allocate_shared_memory(dtype, [2, KB, DP], kv_layout)
    v_ring = gl.allocate_shared_memory(dtype, [_V_STAGES, KB, DP], kv_layout)
    p_buf = gl.allocate_shared_memory(dtype, [CB, _ROWS, KB],
                                      gl.NVMMASharedLayout.get_default_for([_ROWS, KB], dtype))
    a_buf = gl.allocate_shared_memory(gl.float32, [CB, _ROWS], plain)
    r_buf = gl.allocate_shared_memory(gl.float32, [CB, _ROWS], plain)
    m_buf = gl.allocate_shared_memory(gl.float32, [CB, _ROWS], plain)
    # one program handles one chunk: each barrier completes once (phase 0)
    m_ready = gl.allocate_shared_memory(gl.int64, [CB, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [CB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CB):
        mbarrier.init(m_ready.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
    gl.warp_specialize([
        (_softmax_wg, (0, q_ptr, k_ptr, qpos_ptr, q_even, k_even, p_buf, a_buf, r_buf, m_buf, m_ready,
                       p_ready, s_qb, s_qh, s_qs, s_kb, s_kh, s_kt, s_pb, s_ps, S, T, D, Hkv, scale,
                       G, CAUSAL, KB, DP, CB)),
        (_softmax_wg, (1, q_ptr, k_ptr, qpos_ptr, q_odd, k_odd, p_buf, a_buf, r_buf, m_buf, m_ready,
                       p_ready, s_qb, s_qh, s_qs, s_kb, s_kh, s_kt, s_pb, s_ps, S, T, D, Hkv, scale,
                       G, CAUSAL, KB, DP, CB)),
        (_accumulator_wg, (v_ptr, qpos_ptr, acc_st_ptr, ml_st_ptr, count_ptr, out_ptr, lse_ptr,
                           v_ring, p_buf, a_buf, r_buf, m_buf, p_ready, s_vb, s_vh, s_vt, s_pb,
                           s_ps, s_ob, s_oh, s_os, s_lb, s_lh, S, T, D, Hkv, n_chunk, G, CAUSAL,
                           KB, DP, CB, ROWS, GROUP)),
    ], [4, 4], [_REGS_SOFTMAX, _REGS_ACC])


# ------------------------------------------------------------------ host side

_DTYPES = (torch.bfloat16, torch.float16)


def unsupported_reason(a) -> Optional[str]:
    """Why the kernel cannot run the split call ``a`` (a ``SplitLaunch``), or None when it can."""
    q, k, v = a.q, a.k, a.v
    device = gluon_device_reason(q.device)
    if device is not None:
        return device
    if q.dtype not in _DTYPES:
        return f"needs bf16 or fp16 inputs, got {q.dtype}"
    if a.window is not None or a.has_mask:
        return "takes no window and no mask"
    D = q.shape[-1]
    if D % 16 or a.DP > MAX_DP:
        return f"needs a head dim that is a multiple of 16 up to {MAX_DP}, got {D}"
    if q.shape[2] * a.g > BLOCK_M:
        return f"needs every query row of a kv head in one {BLOCK_M}-row tile, got {q.shape[2] * a.g}"
    if any(t.data_ptr() % 16 or any(st % 16 for st in t.stride()[:-1]) for t in (k, v)):
        return "needs k and v 16-byte aligned with strides that are multiples of 16 elements"
    return None


def decode_forward_cuda(a, acc_st: torch.Tensor, ml_st: torch.Tensor, count: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, group: int) -> None:
    """Fill ``out`` and ``lse`` of the split call ``a`` (checked by :func:`unsupported_reason`),
    writing the chunk states to ``acc_st`` / ``ml_st`` (the split launch's layout), counting in
    on ``count`` (zero before, zero after) and loading ``group`` chunk states at once in the merge."""
    q, k, v, pos = a.q, a.k, a.v, a.q_pos
    B, _, S, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    nc, rows_p = acc_st.shape[1], acc_st.shape[2]
    launch(_decode_kernel, (nc, B * Hkv),
           q, k, v, pos, acc_st, ml_st, count, out, lse, q.stride(0), q.stride(1), q.stride(2),
           k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           pos.stride(0), pos.stride(1), out.stride(0), out.stride(1), out.stride(2),
           lse.stride(0), lse.stride(1), S, T, D, Hkv, nc, a.scale, G=a.g, CAUSAL=bool(a.causal),
           KB=a.KB, DP=a.DP, CB=a.CB, ROWS=rows_p,
           GROUP=group, num_warps=4, enable_fp_fusion=False)
