"""Attention for few query rows over many keys (decode) by chunks in parallel: the same bits.

The forward's order (:mod:`tpinv.kernels.triton_attention`) runs a row's key blocks chunk by
chunk, each chunk from the empty state, and merges the chunk states in chunk order.  A chunk's
state depends only on the row and the chunk, so when every query row of a kv head fits one
row tile (``S * g <= BLOCK_M``: decode, short chunked prefill) the chunks need not wait for
each other:

One launch, :func:`_split_kernel`, one program per (chunk, batch row, kv head):

* each program computes its chunk's state of every row of the tile (:func:`chunk_state`: the
  forward's own ``forward_block`` on the same tile, the same blocks, the same visibility and
  NaN handling) and writes it in fp32;
* then it counts itself in on its pair's counter (release); the pair's last program to arrive
  (acquire) merges the written states in chunk order with the forward's own ``merge_state``
  and ``finish_rows`` (:func:`merge_chunk_states`), over the chunk range the forward's
  program computes from the same rows, and sets the counter back to zero.  Nobody waits, and
  which program merges changes no value: the states and their order are fixed.

Since every launch leaves its counters at zero, launches that run one after another share them
(:func:`tpinv.kernels.launch_counters.counters`: one set per stream, one of its own per launch
captured into a CUDA graph), and no launch pays for a memset.

Every value comes from the forward's jit functions on the same values in the same order, so
``out`` and ``lse`` are bit-identical to the one-program forward; only the time differs.
On an sm_90 GPU the same launch runs as a warp-specialized Gluon kernel where it fits
(:mod:`tpinv.kernels.gluon_attention_decode`: the same states, the same merge, the same bits;
:func:`decode_kernel_for`).  Which path a call takes is a speed choice (:func:`use_split`),
never a bits choice.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from tpinv.kernels.device import gluon_module, sm_count
from tpinv.kernels.launch import launch, next_power_of_2
from tpinv.kernels.launch_counters import counters
from tpinv.kernels.triton_attention import finish_rows, forward_block, merge_state, n_chunks
from tpinv.kernels.triton_attention_tiles import block_ranges, row_tile

__all__ = ["split_forward_cuda", "merge_chunks_cuda", "SplitLaunch", "use_split", "n_chunks",
           "decode_kernel_for"]

#: Most (batch row x kv head) pairs for which chunks in parallel pay off (speed only; on an
#: H100 at 4096 cached tokens: faster at 128 pairs, 109 against 117 us; slower at 256, 201
#: against 196 us; docs/benchmarks.md).
SPLIT_MAX_HEADS = 128
#: The merge loads the states of up to MERGE_GROUP chunks at once, at most
#: MERGE_GROUP_ELEMENTS values (speed only: the merge order is fixed).
MERGE_GROUP, MERGE_GROUP_ELEMENTS = 8, 4096
#: Most bytes of chunk states a split call may allocate (speed and memory only).
SPLIT_MAX_STATE_BYTES = 64 << 20
def use_split(B: int, Hkv: int, rows: int, block_m: int, T: int, kb: int, cb: int,
              DP: int) -> bool:
    """Speed choice: chunks in parallel when one row tile holds every row of a kv head, the
    keys span two chunks or more, the one-program launch would leave SMs idle and the chunk
    states stay small."""
    nc = n_chunks(T, kb, cb)
    state_bytes = B * Hkv * nc * max(2, next_power_of_2(rows)) * (DP + 2) * 4
    return (rows <= block_m and nc >= 2 and B * Hkv <= SPLIT_MAX_HEADS
            and state_bytes <= SPLIT_MAX_STATE_BYTES)


@triton.jit
def chunk_range(lo, hi, CB: tl.constexpr):
    """Chunks ``[c_lo, c_hi)`` holding the blocks ``[lo, hi)`` (none when ``hi == lo``)."""
    c_lo = lo // CB
    return c_lo, tl.where(hi > lo, (hi + CB - 1) // CB, c_lo)


@triton.jit
def chunk_state(q, k_base, v_base, s_kt, s_vt, c, lo, f_lo, f_hi, hi, pos, valid, mask_row_ptr,
                s_mt, T, D, window, scale, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, KB: tl.constexpr,
                DP: tl.constexpr, CB: tl.constexpr):
    """``(acc, m, l)`` of chunk ``c`` from the empty state: its blocks inside ``[lo, hi)`` in
    order, those inside ``[f_lo, f_hi)`` without the visibility test (same bits)."""
    b0 = tl.maximum(c * CB, lo)
    b1 = tl.minimum(c * CB + CB, hi)
    m_c = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_c = tl.zeros([BLOCK_M], tl.float32)
    acc_c = tl.zeros([BLOCK_M, DP], tl.float32)
    if WINDOW:  # blocks at the window's start that some rows see only in part
        for blk in range(b0, tl.minimum(f_lo, b1)):
            acc_c, m_c, l_c = forward_block(acc_c, m_c, l_c, q, k_base, v_base, s_kt, s_vt, blk, pos,
                                         valid, mask_row_ptr, s_mt, T, D, window, scale, k_base,
                                         v_base, 0, 0, True, CAUSAL, WINDOW, HAS_MASK, KB, DP,
                                         False)
    for blk in range(tl.maximum(b0, f_lo), tl.minimum(f_hi, b1)):
        acc_c, m_c, l_c = forward_block(acc_c, m_c, l_c, q, k_base, v_base, s_kt, s_vt, blk, pos,
                                     valid, mask_row_ptr, s_mt, T, D, window, scale, k_base,
                                     v_base, 0, 0, False, CAUSAL, WINDOW, HAS_MASK, KB, DP, False)
    for blk in range(tl.maximum(b0, f_hi), b1):
        acc_c, m_c, l_c = forward_block(acc_c, m_c, l_c, q, k_base, v_base, s_kt, s_vt, blk, pos,
                                     valid, mask_row_ptr, s_mt, T, D, window, scale, k_base,
                                     v_base, 0, 0, True, CAUSAL, WINDOW, HAS_MASK, KB, DP, False)
    return acc_c, m_c, l_c


@triton.jit
def merge_chunk_states(qpos_ptr, acc_st_ptr, ml_st_ptr, out_ptr, lse_ptr, bh, s_pb, s_ps, s_ob,
                       s_oh, s_os, s_lb, s_lh, S, T, D, Hkv, n_chunk, window, G: tl.constexpr,
                       CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                       KB: tl.constexpr, DP: tl.constexpr, CB: tl.constexpr, ROWS: tl.constexpr,
                       GROUP: tl.constexpr):
    """Fill the ``(batch row, kv head)`` pair ``bh``'s ``out`` and ``lse`` from its written chunk
    states, merged in chunk order over the chunk range the forward's program computes."""
    b = (bh // Hkv).to(tl.int64)
    hk = (bh % Hkv).to(tl.int64)
    valid, s_idx, hg, pos = row_tile(0, b, qpos_ptr, s_pb, s_ps, S, G, ROWS)
    lo, f_lo, f_hi, hi = block_ranges(pos, valid, T, window, CAUSAL, WINDOW, HAS_MASK, KB)
    c_lo, c_hi = chunk_range(lo, hi, CB)
    rows = tl.arange(0, ROWS)
    offs_d = tl.arange(0, DP)
    acc = tl.zeros([ROWS, DP], tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    for g in range(c_lo, c_hi, GROUP):
        for j in tl.static_range(GROUP):  # loads of a group issued together; merged in order
            c = g + j
            ok = valid & (rows * 0 + c < c_hi)
            at = (bh.to(tl.int64) * n_chunk + c) * ROWS + rows
            # volatile: the states were written by other programs of this launch
            acc_c = tl.load(acc_st_ptr + at[:, None] * DP + offs_d[None, :], mask=ok[:, None],
                            other=0.0, volatile=True)
            m_c = tl.load(ml_st_ptr + at * 2, mask=ok, other=float("-inf"), volatile=True)
            l_c = tl.load(ml_st_ptr + at * 2 + 1, mask=ok, other=0.0, volatile=True)
            if c < c_hi:
                acc, m_i, l_i = merge_state(acc, m_i, l_i, acc_c, m_c, l_c)
    res, lse = finish_rows(acc, m_i, l_i)
    head = hk * G + hg
    s64 = s_idx.to(tl.int64)
    tl.store((out_ptr + b * s_ob + head * s_oh + s64 * s_os)[:, None] + offs_d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_d < D)[None, :])
    tl.store(lse_ptr + b * s_lb + head * s_lh + s64, lse, mask=valid)


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, qpos_ptr, mask_ptr, acc_st_ptr, ml_st_ptr, count_ptr,
                  out_ptr, lse_ptr, s_qb, s_qh, s_qs, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_pb,
                  s_ps, s_mb, s_ms, s_mt, s_ob, s_oh, s_os, s_lb, s_lh, S, T, D, Hkv, n_chunk,
                  n_programs, window, scale, G: tl.constexpr, CAUSAL: tl.constexpr,
                  WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
                  KB: tl.constexpr, DP: tl.constexpr, CB: tl.constexpr, ROWS: tl.constexpr,
                  GROUP: tl.constexpr, STATES: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    if STATES:
        b = (bh // Hkv).to(tl.int64)
        hk = (bh % Hkv).to(tl.int64)
        valid, s_idx, hg, pos = row_tile(0, b, qpos_ptr, s_pb, s_ps, S, G, BLOCK_M)
        lo, f_lo, f_hi, hi = block_ranges(pos, valid, T, window, CAUSAL, WINDOW, HAS_MASK, KB)
        c_lo, c_hi = chunk_range(lo, hi, CB)
        if (c >= c_lo) & (c < c_hi):
            head = hk * G + hg
            s64 = s_idx.to(tl.int64)
            offs_d = tl.arange(0, DP)
            q = tl.load((q_ptr + b * s_qb + head * s_qh + s64 * s_qs)[:, None] + offs_d[None, :],
                        mask=valid[:, None] & (offs_d < D)[None, :], other=0.0)
            acc_c, m_c, l_c = chunk_state(q, k_ptr + b * s_kb + hk * s_kh,
                                          v_ptr + b * s_vb + hk * s_vh, s_kt, s_vt, c, lo, f_lo,
                                          f_hi, hi, pos, valid, mask_ptr + b * s_mb + s64 * s_ms,
                                          s_mt, T, D, window, scale, CAUSAL, WINDOW, HAS_MASK,
                                          BLOCK_M, KB, DP, CB)
            rows = tl.arange(0, BLOCK_M)
            keep = rows < S * G
            at = (bh.to(tl.int64) * n_chunk + c) * ROWS + rows
            tl.store(acc_st_ptr + at[:, None] * DP + offs_d[None, :], acc_c, mask=keep[:, None])
            tl.store(ml_st_ptr + at * 2, m_c, mask=keep)
            tl.store(ml_st_ptr + at * 2 + 1, l_c, mask=keep)
    # the pair's last program to arrive merges (acquire/release, GPU scope; nobody waits)
    tl.debug_barrier()
    seen = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel", scope="gpu") + 1
    if seen == n_programs:
        tl.debug_barrier()
        merge_chunk_states(qpos_ptr, acc_st_ptr, ml_st_ptr, out_ptr, lse_ptr, bh, s_pb, s_ps,
                           s_ob, s_oh, s_os, s_lb, s_lh, S, T, D, Hkv, n_chunk, window, G, CAUSAL,
                           WINDOW, HAS_MASK, KB, DP, CB, ROWS, GROUP)
        tl.store(count_ptr + bh, 0)  # all counted in: at zero for the next launch


class SplitLaunch(NamedTuple):
    """One split call's arguments (checked and laid out by ``attention_forward_cuda``)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_pos: torch.Tensor
    mask: torch.Tensor          # uint8 (a dummy without a mask)
    mask_strides: tuple
    g: int
    causal: bool
    window: Optional[int]
    scale: float
    has_mask: bool
    cfg: object                 # the forward's AttentionConfig
    DP: int
    KB: int
    CB: int

    def flags(self, rows_p: int) -> dict:
        return dict(G=self.g, CAUSAL=bool(self.causal), WINDOW=self.window is not None,
                    HAS_MASK=self.has_mask, KB=self.KB, DP=self.DP, CB=self.CB, ROWS=rows_p)


def _rows_p(a: SplitLaunch) -> int:
    return max(2, next_power_of_2(a.q.shape[2] * a.g))


def _merge_group(rows_p: int, DP: int) -> int:
    return max(1, min(MERGE_GROUP, MERGE_GROUP_ELEMENTS // (rows_p * DP)))


def decode_kernel_for(a: SplitLaunch, gluon: Optional[bool] = None):
    """:mod:`tpinv.kernels.gluon_attention_decode` where it runs the split call ``a``, else None.
    ``gluon``: True, must (ValueError saying why it cannot); False, never; None, where it can
    and its programs fit one wave of the GPU (speed only; on an H200 it was 1.13x faster at one
    sequence of 4096 tokens and, past one wave, 1.12x slower at four, docs/benchmarks.md)."""
    if gluon is False:
        return None
    if gluon is None and (not a.q.is_cuda or n_chunks(a.k.shape[2], a.KB, a.CB) * a.q.shape[0]
                          * a.k.shape[1] > sm_count(a.q.device)):
        return None
    mod = gluon_module("gluon_attention_decode")
    reason = "needs Gluon, which this Triton lacks" if mod is None else mod.unsupported_reason(a)
    if reason is None:
        return mod
    if gluon:
        raise ValueError(f"gluon=True: the Gluon decode kernel {reason}")
    return None


def _launch(a: SplitLaunch, acc_st: torch.Tensor, ml_st: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, states: bool) -> None:
    q, k, v = a.q, a.k, a.v
    B, _, S, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    nc, rows_p = acc_st.shape[1], acc_st.shape[2]
    programs = nc if states else 1
    count = counters(B * Hkv, q.device)
    s_mb, s_ms, s_mt = a.mask_strides
    launch(_split_kernel, (programs, B * Hkv),
           q, k, v, a.q_pos, a.mask, acc_st, ml_st, count, out, lse,
           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2), a.q_pos.stride(0), a.q_pos.stride(1),
           s_mb, s_ms, s_mt, out.stride(0), out.stride(1), out.stride(2),
           lse.stride(0), lse.stride(1), S, T, D, Hkv, nc, programs, int(a.window or 0), a.scale,
           BLOCK_M=a.cfg.block_m, **a.flags(rows_p),
           GROUP=_merge_group(rows_p, a.DP), STATES=states,
           num_warps=a.cfg.num_warps, num_stages=a.cfg.num_stages, enable_fp_fusion=False)


def split_forward_cuda(a: SplitLaunch, out: torch.Tensor, lse: torch.Tensor,
                       gluon: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill ``out`` and ``lse`` through chunks in parallel, in one launch (the Gluon kernel's or
    the Triton kernel's, :func:`decode_kernel_for`).  Returns the chunk states it merged:
    ``(acc [B * Hkv, chunks, rows, DP], (m, l) [B * Hkv, chunks, rows, 2])`` in fp32 (only the
    chunks a row's tile visits are written)."""
    B, Hkv, T = a.q.shape[0], a.k.shape[1], a.k.shape[2]
    nc, rows_p = n_chunks(T, a.KB, a.CB), _rows_p(a)
    acc_st = torch.empty((B * Hkv, nc, rows_p, a.DP), dtype=torch.float32, device=a.q.device)
    ml_st = torch.empty((B * Hkv, nc, rows_p, 2), dtype=torch.float32, device=a.q.device)
    kernel = decode_kernel_for(a, gluon)
    if kernel is not None:
        kernel.decode_forward_cuda(a, acc_st, ml_st, counters(B * Hkv, a.q.device), out, lse,
                                   _merge_group(rows_p, a.DP))
    else:
        _launch(a, acc_st, ml_st, out, lse, True)
    return acc_st, ml_st


def merge_chunks_cuda(a: SplitLaunch, acc_st: torch.Tensor, ml_st: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fill ``out`` and ``lse`` from given chunk states alone: the split launch's own merge
    (one program a pair), for checking what the states carry."""
    _launch(a, acc_st, ml_st, out, lse, False)
