"""The attention backward's dK/dV kernel (Triton): each key block's gradients by one program.

One program per (block of key slots, batch row, kv head) walks the row tiles of the interleaved
rows ``r = s * g + hg`` (all ``g`` query heads of the kv head together) in increasing order,
``dV += p^T dO`` and ``dK += dS^T q`` in fp32, ``p^T`` and ``dS^T`` computed slot-major from
``k q^T`` and ``v dO^T``.  It visits only the tiles between the first and the last row that may
see the block (the others would add exact zeros), and the tiles whose rows all see the whole
block skip the visibility test (the same values).  The order and why it is invariant are in
:mod:`tpinv.kernels.triton_attention_bwd`, which launches it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tpinv.kernels.triton_attention_tiles import load_kv_block, query_tile

__all__ = ["dkdv_kernel"]

_BIG = tl.constexpr(1 << 62)


@triton.jit
def _tile_span(qpos_ptr, s_pb, s_ps, b, S, j0, j_last, T, window, CAUSAL: tl.constexpr,
               WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, G: tl.constexpr,
               BLOCK_M: tl.constexpr, KB: tl.constexpr, SCAN: tl.constexpr):
    """Row tiles ``[t_lo, t_hi)`` spanning every row that may see a slot of ``[j0, j_last]``, and
    ``[f_lo, f_hi)`` inside it whose rows are all valid and see every slot of the block (no
    visibility test needed there; empty with a window or a mask, or past ``T``)."""
    s_first = tl.min(tl.full([SCAN], _BIG, tl.int64), 0)
    s_last = -s_first
    s_part = s_last      # the last row that sees only part of the block (or none of it)
    for s0 in range(0, S, SCAN):
        s = s0 + tl.arange(0, SCAN)
        inside = s < S
        pos = tl.load(qpos_ptr + b * s_pb + s.to(tl.int64) * s_ps, mask=inside, other=0)
        cand = inside
        if CAUSAL:
            cand = cand & (pos >= j0)
        if WINDOW:
            cand = cand & (pos - window < j_last)
        s64 = s.to(tl.int64)
        s_first = tl.minimum(s_first, tl.min(tl.where(cand, s64, _BIG), 0))
        s_last = tl.maximum(s_last, tl.max(tl.where(cand, s64, -_BIG), 0))
        if CAUSAL:
            s_part = tl.maximum(s_part, tl.max(tl.where(inside & (pos < j_last), s64, -_BIG), 0))
    seen = s_last >= 0
    t_lo = tl.where(seen, (s_first * G) // BLOCK_M, 0)
    t_hi = tl.where(seen, (s_last * G + G - 1) // BLOCK_M + 1, 0)
    f_hi = tl.minimum(t_hi, (S * G) // BLOCK_M)
    f_lo = tl.where(s_part >= 0, (s_part * G + G - 1) // BLOCK_M + 1, t_lo)
    f_lo = tl.minimum(tl.maximum(f_lo, t_lo), f_hi)
    if WINDOW or HAS_MASK:
        f_lo = t_hi
    f_lo = tl.where(j0 + KB <= T, f_lo, t_hi)
    f_hi = tl.maximum(f_hi, f_lo)
    return t_lo.to(tl.int32), f_lo.to(tl.int32), f_hi.to(tl.int32), t_hi.to(tl.int32)


@triton.jit
def _visibility_t(pos, valid, slots, T, window, mask_row_ptr, s_mt, CAUSAL: tl.constexpr,
                  WINDOW: tl.constexpr, HAS_MASK: tl.constexpr):
    """``[slots, rows]`` bool: may the row at ``pos`` see key slot ``j`` (``visibility``'s transpose)."""
    sl = slots.to(tl.int64)[:, None]
    vis = valid[None, :] & (sl < T)
    if CAUSAL:
        vis = vis & (sl <= pos[None, :])
    if WINDOW:
        vis = vis & (sl > pos[None, :] - window)
    if HAS_MASK:   # read as [rows, slots], along the mask's rows (the transposed read broke ptxas 12.8)
        m = tl.load(mask_row_ptr[:, None] + slots.to(tl.int64)[None, :] * s_mt, mask=tl.trans(vis),
                    other=0)
        vis = vis & tl.trans(m != 0)
    return vis


@triton.jit
def _dkdv_tile(dk, dv, k, v, t, b, hk, slots, qpos_ptr, q_ptr, do_ptr, lse_ptr, delta_ptr,
               mask_ptr, s_pb, s_ps, s_mb, s_ms, s_mt, s_qb, s_qh, s_qs, s_db, s_dh, s_ds,
               s_lb, s_lh, s_ls, s_xb, s_xh, S, T, D, window, scale, q_desc, do_desc,
               MASKED: tl.constexpr, G: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, DP: tl.constexpr, TMA: tl.constexpr):
    """One row tile's terms, with the block's slots as the dots' rows: ``dV += p^T dO``,
    ``dK += dS^T q`` (``p^T``, ``dS^T`` computed as ``[slots, rows]`` from ``k q^T`` and ``v dO^T``)."""
    valid, pos, head, s64, q, do, lse, delta = query_tile(
        t, b, hk, qpos_ptr, q_ptr, do_ptr, lse_ptr, delta_ptr, s_pb, s_ps, s_qb, s_qh, s_qs, s_db,
        s_dh, s_ds, s_lb, s_lh, s_ls, s_xb, s_xh, S, D, q_desc, do_desc, G, BLOCK_M, DP, TMA)
    st = tl.dot(k, tl.trans(q), input_precision="ieee") * scale
    if MASKED:
        vis = _visibility_t(pos, valid, slots, T, window, mask_ptr + b * s_mb + s64 * s_ms, s_mt,
                            CAUSAL, WINDOW, HAS_MASK)
        pt = tl.where(vis, tl.exp(st - lse[None, :]), 0.0)
    else:
        pt = tl.exp(st - lse[None, :])
    dv = tl.dot(pt.to(do.dtype), do, dv, input_precision="ieee")
    dpt = tl.dot(v, tl.trans(do), input_precision="ieee")
    if MASKED:
        dst = tl.where(vis, pt * (dpt - delta[None, :]), 0.0)
    else:
        dst = pt * (dpt - delta[None, :])
    dk = tl.dot(dst.to(q.dtype), q, dk, input_precision="ieee")
    return dk, dv


@triton.jit
def dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, q_desc, do_desc, lse_ptr, delta_ptr, qpos_ptr,
                 mask_ptr,
                 dk_ptr, dv_ptr, s_qb, s_qh, s_qs, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt,
                 s_db, s_dh, s_ds, s_lb, s_lh, s_ls, s_xb, s_xh, s_pb, s_ps, s_mb, s_ms, s_mt,
                 s_kgb, s_kgh, s_kgt, s_vgb, s_vgh, s_vgt,
                 S, T, D, Hkv, window, scale, G: tl.constexpr, CAUSAL: tl.constexpr,
                 WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
                 KB: tl.constexpr, DP: tl.constexpr, SCAN: tl.constexpr, TMA: tl.constexpr):
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    hk = (bh % Hkv).to(tl.int64)
    slots = n * KB + tl.arange(0, KB)
    offs_d = tl.arange(0, DP)
    k = load_kv_block(k_ptr + b * s_kb + hk * s_kh, s_kt, slots, offs_d, T, D)
    v = load_kv_block(v_ptr + b * s_vb + hk * s_vh, s_vt, slots, offs_d, T, D)
    j_last = tl.minimum(n * KB + KB, T) - 1
    t_lo, f_lo, f_hi, t_hi = _tile_span(qpos_ptr, s_pb, s_ps, b, S, n * KB, j_last, T, window,
                                        CAUSAL, WINDOW, HAS_MASK, G, BLOCK_M, KB, SCAN)
    dk = tl.zeros([KB, DP], tl.float32)
    dv = tl.zeros([KB, DP], tl.float32)
    # the row tiles in increasing order; those in [f_lo, f_hi) see the whole block
    for t in range(t_lo, f_lo):
        dk, dv = _dkdv_tile(dk, dv, k, v, t, b, hk, slots, qpos_ptr, q_ptr, do_ptr, lse_ptr,
                            delta_ptr, mask_ptr, s_pb, s_ps, s_mb, s_ms, s_mt, s_qb, s_qh, s_qs,
                            s_db, s_dh, s_ds, s_lb, s_lh, s_ls, s_xb, s_xh, S, T, D, window, scale,
                            q_desc, do_desc, True, G, CAUSAL, WINDOW, HAS_MASK, BLOCK_M, DP, TMA)
    for t in range(f_lo, f_hi):
        dk, dv = _dkdv_tile(dk, dv, k, v, t, b, hk, slots, qpos_ptr, q_ptr, do_ptr, lse_ptr,
                            delta_ptr, mask_ptr, s_pb, s_ps, s_mb, s_ms, s_mt, s_qb, s_qh, s_qs,
                            s_db, s_dh, s_ds, s_lb, s_lh, s_ls, s_xb, s_xh, S, T, D, window, scale,
                            q_desc, do_desc, False, G, CAUSAL, WINDOW, HAS_MASK, BLOCK_M, DP, TMA)
    for t in range(f_hi, t_hi):
        dk, dv = _dkdv_tile(dk, dv, k, v, t, b, hk, slots, qpos_ptr, q_ptr, do_ptr, lse_ptr,
                            delta_ptr, mask_ptr, s_pb, s_ps, s_mb, s_ms, s_mt, s_qb, s_qh, s_qs,
                            s_db, s_dh, s_ds, s_lb, s_lh, s_ls, s_xb, s_xh, S, T, D, window, scale,
                            q_desc, do_desc, True, G, CAUSAL, WINDOW, HAS_MASK, BLOCK_M, DP, TMA)
    ok_out = (slots < T)[:, None] & (offs_d < D)[None, :]
    sl = slots.to(tl.int64)[:, None]
    tl.store(dk_ptr + b * s_kgb + hk * s_kgh + sl * s_kgt + offs_d[None, :],
             (dk * scale + 0.0).to(dk_ptr.dtype.element_ty), mask=ok_out)
    tl.store(dv_ptr + b * s_vgb + hk * s_vgh + sl * s_vgt + offs_d[None, :],
             (dv + 0.0).to(dv_ptr.dtype.element_ty), mask=ok_out)
