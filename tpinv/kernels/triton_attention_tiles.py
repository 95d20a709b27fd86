"""Device helpers the attention kernels share: row tiles, visible key ranges, visibility, K/V blocks.

Each helper is one step of the order :mod:`tpinv.kernels.triton_attention` defines, written once
so the forward, the chunks-in-parallel path and the dQ kernel take the same step the same way:
which rows a tile holds (the interleaved ``r = s * g + hg``), which key blocks some row of it may
see and which every row sees whole, which slots a row sees, the zeroing of slots no row sees
(junk or NaN in an unused cache slot cannot leak through ``0 * NaN``), the masked pointer
loads of a key block (zeros past ``T`` and past the head dim), and the backward's query tile
(``q``, ``dO``, ``lse``, ``Delta`` of its rows, through descriptors where the caller has them).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["row_tile", "block_ranges", "visibility", "clean_kv", "poison_rows", "load_kv_block",
           "load_kv_blocks", "load_query_rows", "query_tile"]

_BIG = tl.constexpr(1 << 62)


@triton.jit
def row_tile(tile, b, qpos_ptr, s_pb, s_ps, S, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows ``r = s * G + hg`` of one tile: ``(valid, s, hg, pos)``."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < S * G
    s_idx = rows // G
    hg = rows % G
    pos = tl.load(qpos_ptr + b * s_pb + s_idx.to(tl.int64) * s_ps, mask=valid, other=0)
    return valid, s_idx, hg, pos


@triton.jit
def block_ranges(pos, valid, T, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 HAS_MASK: tl.constexpr, KB: tl.constexpr):
    """KV blocks ``[lo, hi)`` some row may see, and ``[f_lo, f_hi)`` inside it that every
    row of the tile sees entirely (no visibility test needed there)."""
    pmin = tl.min(tl.where(valid, pos, _BIG), 0)
    pmax = tl.max(tl.where(valid, pos, -_BIG), 0)
    T64 = pmin * 0 + T
    hi_slot = T64
    full_hi_slot = T64
    lo_slot = pmin * 0
    full_lo_slot = pmin * 0
    if CAUSAL:
        hi_slot = tl.minimum(hi_slot, pmax + 1)
        full_hi_slot = tl.minimum(full_hi_slot, pmin + 1)
    if WINDOW:
        lo_slot = tl.maximum(lo_slot, pmin - window + 1)
        full_lo_slot = tl.maximum(full_lo_slot, pmax - window + 1)
    lo = lo_slot // KB
    hi = tl.where(hi_slot > lo_slot, (hi_slot + KB - 1) // KB, lo)
    f_lo = tl.minimum(tl.maximum((full_lo_slot + KB - 1) // KB, lo), hi)
    f_hi = tl.minimum(tl.maximum(tl.maximum(full_hi_slot, 0) // KB, f_lo), hi)
    if HAS_MASK:
        f_lo = lo
        f_hi = lo
    return lo.to(tl.int32), f_lo.to(tl.int32), f_hi.to(tl.int32), hi.to(tl.int32)


@triton.jit
def visibility(pos, valid, slots, T, window, mask_row_ptr, s_mt, CAUSAL: tl.constexpr,
               WINDOW: tl.constexpr, HAS_MASK: tl.constexpr):
    """``[rows, slots]`` bool: may the row at ``pos`` see key slot ``j``."""
    sl = slots.to(tl.int64)[None, :]
    vis = valid[:, None] & (sl < T)
    if CAUSAL:
        vis = vis & (sl <= pos[:, None])
    if WINDOW:
        vis = vis & (sl > pos[:, None] - window)
    if HAS_MASK:
        m = tl.load(mask_row_ptr[:, None] + sl * s_mt, mask=vis, other=0)
        vis = vis & (m != 0)
    return vis


@triton.jit
def clean_kv(vis, scored, summed):
    """Zero the slots no row of the tile sees; also the non-finite entries of ``summed``.

    ``scored`` (K in the forward) only meets ``q`` in per-slot scores, which are masked;
    ``summed`` (V in the forward, K in dQ) is summed over slots with ``0 * x`` for a slot a
    row does not see, so ``NaN`` from a slot another row sees would leak.  Returns
    ``(scored, summed, bad)``; ``bad`` marks the non-finite entries of seen slots, which
    :func:`poison_rows` gives back (as NaN) to the rows that see them.
    """
    seen = (tl.max(vis.to(tl.int32), 0) > 0)[:, None]
    scored = tl.where(seen, scored, tl.zeros_like(scored))
    # NaN or +-inf, spelled without `~` (Triton 3.2/3.3's interpreter cannot negate a boolean block)
    nonfinite = (summed != summed) | (tl.abs(summed) == float("inf"))
    bad = seen & nonfinite
    summed = tl.where(nonfinite, tl.zeros_like(summed), tl.where(seen, summed, tl.zeros_like(summed)))
    return scored, summed, bad


@triton.jit
def poison_rows(acc, vis, bad):
    """NaN where a row sees a slot whose value (column of ``bad``) is non-finite."""
    if tl.max(tl.max(bad.to(tl.int32), 1), 0) > 0:
        hits = tl.dot(vis.to(tl.float16), bad.to(tl.float16), out_dtype=tl.float32)
        acc = tl.where(hits > 0.0, float("nan"), acc)
    return acc


@triton.jit
def load_kv_block(base, s_t, slots, offs_d, T, D):
    ok = (slots < T)[:, None] & (offs_d < D)[None, :]
    return tl.load(base + slots.to(tl.int64)[:, None] * s_t + offs_d[None, :], mask=ok, other=0.0)


@triton.jit
def load_kv_blocks(k_base, v_base, s_kt, s_vt, blk, T, D, KB: tl.constexpr, DP: tl.constexpr):
    """``(slots, K, V)`` of key block ``blk``: absolute slots ``blk * KB + [0, KB)``, the tiles
    zero past ``T`` and past the head dim."""
    slots = blk * KB + tl.arange(0, KB)
    offs_d = tl.arange(0, DP)
    return (slots, load_kv_block(k_base, s_kt, slots, offs_d, T, D),
            load_kv_block(v_base, s_vt, slots, offs_d, T, D))


@triton.jit
def load_query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, b, head, s64, valid, offs_d, D,
                    s_qb, s_qh, s_qs, s_db, s_dh, s_ds, s_lb, s_lh, s_ls, s_xb, s_xh):
    """``q``, ``dO`` ``[rows, DP]`` and ``lse``, ``delta`` ``[rows]`` of a row tile (zeros
    where a row is not valid or past the head dim)."""
    ok2 = valid[:, None] & (offs_d < D)[None, :]
    q = tl.load((q_ptr + b * s_qb + head * s_qh + s64 * s_qs)[:, None] + offs_d[None, :],
                mask=ok2, other=0.0)
    do = tl.load((do_ptr + b * s_db + head * s_dh + s64 * s_ds)[:, None] + offs_d[None, :],
                 mask=ok2, other=0.0)
    lse = tl.load(lse_ptr + b * s_lb + head * s_lh + s64 * s_ls, mask=valid, other=0.0)
    delta = tl.load(delta_ptr + b * s_xb + head * s_xh + s64, mask=valid, other=0.0)
    return q, do, lse, delta


@triton.jit
def query_tile(t, b, hk, qpos_ptr, q_ptr, do_ptr, lse_ptr, delta_ptr, s_pb, s_ps, s_qb, s_qh,
               s_qs, s_db, s_dh, s_ds, s_lb, s_lh, s_ls, s_xb, s_xh, S, D, q_desc, do_desc,
               G: tl.constexpr, BLOCK_M: tl.constexpr, DP: tl.constexpr, TMA: tl.constexpr):
    """Row tile ``t`` of kv head ``hk``: ``(valid, pos, head, s, q, dO, lse, delta)``; with
    ``TMA`` the ``q`` and ``dO`` tiles come through descriptors of ``[B, S, Hkv, G, D]``
    (:func:`~tpinv.kernels.triton_attention_tma.row_descriptor`): the same rows, the same zeros."""
    valid, s_idx, hg, pos = row_tile(t, b, qpos_ptr, s_pb, s_ps, S, G, BLOCK_M)
    head = hk * G + hg
    s64 = s_idx.to(tl.int64)
    if TMA:
        s0 = t * (BLOCK_M // G)  # int32 in the kernel (a Python int under the interpreter)
        b32 = b.to(tl.int32)
        hk32 = hk.to(tl.int32)
        q = q_desc.load([b32, s0, hk32, 0, 0]).reshape(BLOCK_M, DP)
        do = do_desc.load([b32, s0, hk32, 0, 0]).reshape(BLOCK_M, DP)
        lse = tl.load(lse_ptr + b * s_lb + head * s_lh + s64 * s_ls, mask=valid, other=0.0)
        delta = tl.load(delta_ptr + b * s_xb + head * s_xh + s64, mask=valid, other=0.0)
    else:
        q, do, lse, delta = load_query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, b, head, s64, valid,
                                            tl.arange(0, DP), D, s_qb, s_qh, s_qs, s_db, s_dh, s_ds,
                                            s_lb, s_lh, s_ls, s_xb, s_xh)
    return valid, pos, head, s64, q, do, lse, delta
