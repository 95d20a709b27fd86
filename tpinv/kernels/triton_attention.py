"""Invariant attention forward on CUDA (Triton): a query's bits never depend on the launch.

Order fixed, per query row:

* the rows of a program are the flattened ``(s, hg)`` pairs of the ``g`` query heads of
  one kv head, interleaved ``r = s * g + hg``, in tiles of ``BLOCK_M`` rows;
* score ``s_j = dot(q, k_j) * scale`` in fp32 (tensor-core dot; fp32 inputs use the exact
  ``ieee`` dot, never TF32);
* key slots are cut into blocks of :data:`~tpinv.kernels.reference_attention.KV_BLOCK` slots
  starting at absolute slot 0, and the blocks into chunks of :data:`KV_CHUNK_BLOCKS` blocks
  (chunk ``c`` holds blocks ``[c * KV_CHUNK_BLOCKS, (c + 1) * KV_CHUNK_BLOCKS)``);
* within a chunk, from the empty state, the blocks in increasing order by an online softmax
  ``m' = max(m, max_block s)``, ``alpha = exp(m - m')`` (exactly 1 when ``m' == m``),
  ``l = l * alpha + sum_block p``, ``acc = acc * alpha + dot(p, v)``;
* the chunks' states merged into the row's state in increasing chunk order by
  ``m' = max(m, m_c)``, ``a = exp(m - m')``, ``b = exp(m_c - m')`` (each exactly 1 at the max),
  ``l = l * a + l_c * b``, ``acc = acc * a + acc_c * b``;
* ``out = acc * (1 / l)`` (the reciprocal correctly rounded, once a row), rounded once to the
  input dtype; ``lse = m + log(l)`` in fp32.

A chunk's state depends only on the row and the chunk, so a call with few rows and many keys
(decode) may compute its chunks in parallel programs and merge them in a second kernel
(:mod:`tpinv.kernels.triton_attention_split`): the same operations on the same values, the
same bits as one program walking the chunks.

A call whose keys all lie in the first chunk (``T <= KV_BLOCK * KV_CHUNK_BLOCKS``) never
merges: its launch leaves the merged state out (``MERGE=False``: one fp32 accumulator in
registers, not two).  Its bits are the merging kernel's: merging
one chunk into the empty state gives the chunk's own ``(acc, m, l)``, up to the sign of a zero
``acc`` entry, which ``finish_rows`` drops.  The launch config comes from a table per (dtype,
padded head dim), never from B, S or T (for the kernel without merged state too: it was the
best or tied among five on an H200 at one-chunk prefill shapes, docs/benchmarks.md).  For 16-bit inputs every listed config (64 or 128 rows a
tile, wgmma dots) gives a row the same bits wherever it sits; 32-row tiles run other tensor-core
instructions and do not, so none is listed (the GPU tests run each config).  A slot a row
cannot see gets ``p = 0`` exactly; slots no row of the tile can see are zeroed before the dots (junk or NaN in an
unused KV-cache slot cannot leak through ``0 * NaN``); a block no row sees leaves
``(m, l, acc)`` bit-identical, so blocks outside the tile's visible range are skipped.
Blocks every row of the tile sees entirely take a path without the visibility test: it
computes the same bits for each row as the masked path.  K/V blocks come through TMA
descriptors wherever one can read them, else pointer loads: the same tiles, the same bits
(:mod:`tpinv.kernels.triton_attention_tma`).  A query that sees no key gets
``out = 0`` and ``lse = -inf``.  Semantics are those of :mod:`tpinv.kernels.reference_attention`;
bits differ from the CPU kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from tpinv.kernels.launch import cdiv, launch, next_power_of_2, operands_key
from tpinv.kernels.layout import empty_in_layout_of
from tpinv.kernels.reference_attention import KV_BLOCK, check_attention_inputs
from tpinv.kernels.triton_attention_tiles import (block_ranges, clean_kv, load_kv_blocks, poison_rows,
                                                  row_tile, visibility)
from tpinv.kernels.triton_attention_tma import attention_plan, kept_for, kv_descriptors, load_kv_tma

__all__ = ["attention_forward_cuda", "AttentionConfig", "forward_config", "one_chunk", "padded_head_dim",
           "MAX_HEAD_DIM", "KV_CHUNK_BLOCKS", "FORWARD_CANDIDATES"]

#: Largest head dim the kernels take (padded to a power of two >= 16 inside).
MAX_HEAD_DIM = 256
#: Key blocks per chunk: part of the order (the bits), like ``KV_BLOCK``; never a launch choice.
KV_CHUNK_BLOCKS = 8


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int
    num_warps: int
    num_stages: int


#: The forward config per (dtype, padded head dim).
_FORWARD_TABLE = {
    16: AttentionConfig(64, 4, 3), 32: AttentionConfig(64, 4, 3),
    64: AttentionConfig(64, 4, 3), 128: AttentionConfig(64, 4, 3),
    256: AttentionConfig(64, 8, 2),
}
#: Launch configs for 16-bit inputs that the GPU tests run beside the tables' (same bits).
FORWARD_CANDIDATES = (AttentionConfig(64, 4, 2), AttentionConfig(128, 8, 3), AttentionConfig(128, 4, 2))


def padded_head_dim(D: int) -> int:
    if D < 1 or D > MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} is not supported; expected 1 <= D <= {MAX_HEAD_DIM}")
    return max(16, next_power_of_2(D))


#: fp32 runs the exact FMA dot (no tensor cores): small tiles, no pipeline (shared memory).
_FP32_CONFIG = AttentionConfig(32, 4, 1)


def forward_config(dtype: torch.dtype, DP: int) -> AttentionConfig:
    """The forward's launch config for ``dtype`` and padded head dim ``DP`` (nothing else)."""
    return _FP32_CONFIG if dtype == torch.float32 else _FORWARD_TABLE[DP]


def n_chunks(T: int, kb: int, cb: int) -> int:
    """Chunks of ``cb`` blocks of ``kb`` key slots covering ``T`` slots."""
    return cdiv(cdiv(T, kb), cb)


def one_chunk(T: int) -> bool:
    """Do key slots ``[0, T)`` lie in the first chunk (no chunk merge in any row)?"""
    return n_chunks(T, KV_BLOCK, KV_CHUNK_BLOCKS) <= 1


# ------------------------------------------------------------------ forward kernel

@triton.jit
def forward_block(acc, m_i, l_i, q, k_base, v_base, s_kt, s_vt, blk, pos, valid, mask_row_ptr, s_mt,
                  T, D, window, scale, k_desc, v_desc, b32, hk32, MASKED: tl.constexpr,
                  CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                  KB: tl.constexpr, DP: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        slots, k, v = load_kv_tma(k_desc, v_desc, b32, hk32, blk, KB, DP)
    else:
        slots, k, v = load_kv_blocks(k_base, v_base, s_kt, s_vt, blk, T, D, KB, DP)
    if MASKED:
        vis = visibility(pos, valid, slots, T, window, mask_row_ptr, s_mt, CAUSAL, WINDOW,
                         HAS_MASK)
        k, v, bad = clean_kv(vis, k, v)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(vis, s, float("-inf"))
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_new == m_i, 1.0, tl.exp(m_i - m_safe))
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    if MASKED:
        acc = poison_rows(acc, vis, bad)
    return acc, m_new, l_i


@triton.jit
def merge_state(acc, m, l, acc_c, m_c, l_c):
    """The row state ``(acc, m, l)`` with chunk state ``(acc_c, m_c, l_c)`` merged after it."""
    m_new = tl.maximum(m, m_c)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.where(m_new == m, 1.0, tl.exp(m - m_safe))
    b = tl.where(m_new == m_c, 1.0, tl.exp(m_c - m_safe))
    return acc * a[:, None] + acc_c * b[:, None], m_new, l * a + l_c * b


@triton.jit
def end_of_chunk(acc_r, m_r, l_r, acc, m_i, l_i, blk, hi, CB: tl.constexpr):
    """After block ``blk``: at the last block of a chunk, unless it is the range's last, merge
    the chunk's state into the merged state ``(acc_r, m_r, l_r)`` and restart from empty.

    One loop over the blocks with this test keeps the forward's pipeline (a loop per chunk
    cost the prefill 30-70% on an H100); the states merged are the chunks' all the same."""
    nxt = blk + 1 + hi * 0  # a tensor in every mode (Triton 3.2's interpreter cannot `&` a bool)
    if (nxt % CB == 0) & (nxt < hi):
        acc_r, m_r, l_r = merge_state(acc_r, m_r, l_r, acc, m_i, l_i)
        acc = tl.zeros_like(acc)
        m_i = tl.full(m_i.shape, float("-inf"), tl.float32)
        l_i = tl.zeros_like(l_i)
    return acc_r, m_r, l_r, acc, m_i, l_i


@triton.jit
def finish_rows(acc, m_i, l_i):
    """``(out, lse)`` of row states: ``acc * (1 / l)`` (the reciprocal correctly rounded, once a
    row: a division an element cost the forward 8%), ``m + log(l)``."""
    seen = l_i != 0.0  # 0: no visible key; NaN (a NaN key or value seen) propagates as in PyTorch
    l_safe = tl.where(seen, l_i, 1.0)
    inv = tl.math.div_rn(tl.full(l_safe.shape, 1.0, tl.float32), l_safe)
    res = tl.where(seen[:, None], acc * inv[:, None], 0.0) + 0.0
    return res, tl.where(seen, m_i + tl.log(l_safe), float("-inf"))


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, qpos_ptr, mask_ptr, out_ptr, lse_ptr,
                     s_qb, s_qh, s_qs, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_pb, s_ps,
                     s_mb, s_ms, s_mt, s_ob, s_oh, s_os, s_lb, s_lh,
                     S, T, D, Hkv, n_tiles, window, scale,
                     G: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                     HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, KB: tl.constexpr,
                     DP: tl.constexpr, CB: tl.constexpr, MERGE: tl.constexpr, TMA: tl.constexpr):
    tile = n_tiles - 1 - tl.program_id(0)  # longest causal tiles first (speed only)
    bh = tl.program_id(1)
    b32 = bh // Hkv
    hk32 = bh % Hkv
    b = (bh // Hkv).to(tl.int64)
    hk = (bh % Hkv).to(tl.int64)
    valid, s_idx, hg, pos = row_tile(tile, b, qpos_ptr, s_pb, s_ps, S, G, BLOCK_M)
    head = hk * G + hg
    s64 = s_idx.to(tl.int64)
    offs_d = tl.arange(0, DP)
    q_rows = q_ptr + b * s_qb + head * s_qh + s64 * s_qs
    q = tl.load(q_rows[:, None] + offs_d[None, :],
                mask=valid[:, None] & (offs_d < D)[None, :], other=0.0)
    k_base = k_ptr + b * s_kb + hk * s_kh
    v_base = v_ptr + b * s_vb + hk * s_vh
    mask_row_ptr = mask_ptr + b * s_mb + s64 * s_ms
    lo, f_lo, f_hi, hi = block_ranges(pos, valid, T, window, CAUSAL, WINDOW, HAS_MASK, KB)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    if MERGE:
        acc_r = tl.zeros([BLOCK_M, DP], tl.float32)  # the merged state of the chunks before
        m_r = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_r = tl.zeros([BLOCK_M], tl.float32)
    if WINDOW:  # blocks at the window's start that some rows see only in part
        for blk in range(lo, f_lo):
            acc, m_i, l_i = forward_block(acc, m_i, l_i, q, k_base, v_base, s_kt, s_vt, blk, pos,
                                          valid, mask_row_ptr, s_mt, T, D, window, scale, k_desc,
                                          v_desc, b32, hk32, True, CAUSAL, WINDOW, HAS_MASK, KB,
                                          DP, TMA)
            if MERGE:
                acc_r, m_r, l_r, acc, m_i, l_i = end_of_chunk(acc_r, m_r, l_r, acc, m_i, l_i, blk,
                                                              hi, CB)
    for blk in range(f_lo, f_hi):
        acc, m_i, l_i = forward_block(acc, m_i, l_i, q, k_base, v_base, s_kt, s_vt, blk, pos, valid,
                                      mask_row_ptr, s_mt, T, D, window, scale, k_desc, v_desc, b32,
                                      hk32, False, CAUSAL, WINDOW, HAS_MASK, KB, DP, TMA)
        if MERGE:
            acc_r, m_r, l_r, acc, m_i, l_i = end_of_chunk(acc_r, m_r, l_r, acc, m_i, l_i, blk, hi, CB)
    for blk in range(f_hi, hi):
        acc, m_i, l_i = forward_block(acc, m_i, l_i, q, k_base, v_base, s_kt, s_vt, blk, pos, valid,
                                      mask_row_ptr, s_mt, T, D, window, scale, k_desc, v_desc, b32,
                                      hk32, True, CAUSAL, WINDOW, HAS_MASK, KB, DP, TMA)
        if MERGE:
            acc_r, m_r, l_r, acc, m_i, l_i = end_of_chunk(acc_r, m_r, l_r, acc, m_i, l_i, blk, hi, CB)
    if MERGE:
        acc, m_i, l_i = merge_state(acc_r, m_r, l_r, acc, m_i, l_i)  # the last chunk
    res, lse = finish_rows(acc, m_i, l_i)
    o_rows = out_ptr + b * s_ob + head * s_oh + s64 * s_os
    tl.store(o_rows[:, None] + offs_d[None, :], res.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_d < D)[None, :])
    tl.store(lse_ptr + b * s_lb + head * s_lh + s64, lse, mask=valid)


# ------------------------------------------------------------------ host side

_SPLIT = None


def _split_module():
    """:mod:`tpinv.kernels.triton_attention_split` (imported on first use: it imports this)."""
    global _SPLIT
    if _SPLIT is None:
        from tpinv.kernels import triton_attention_split
        _SPLIT = triton_attention_split
    return _SPLIT


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def mask_args(mask: Optional[torch.Tensor], like: torch.Tensor):
    """``(tensor, strides)`` of the mask as uint8 (a 1-element dummy when there is none: never
    read, kept per device rather than allocated and zeroed every call)."""
    if mask is None:
        dummy = _NO_MASK.get(like.device)
        if dummy is None:
            dummy = torch.zeros(1, dtype=torch.uint8, device=like.device)
            if not (dummy.is_cuda and torch.cuda.is_current_stream_capturing()):  # not a graph's pool
                _NO_MASK[like.device] = dummy
        return dummy, (0, 0, 0)
    m = mask.view(torch.uint8)
    return m, tuple(m.stride())


_NO_MASK: dict = {}   # device -> the dummy mask tensor


def resolve_scale(scale: Optional[float], D: int) -> float:
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    return scale


def attention_forward_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                           mask: Optional[torch.Tensor] = None, causal: bool = True,
                           window: Optional[int] = None, scale: Optional[float] = None, *,
                           split: Optional[bool] = None, config: Optional[AttentionConfig] = None,
                           merge: Optional[bool] = None, tma: Optional[bool] = None,
                           gluon: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, S, D] in q.dtype, lse [B, Hq, S] fp32)`` of ``tpinv::attention``.

    ``split``, ``config``, ``merge`` and ``tma`` pick the launch, never the bits: chunks in
    parallel programs (:mod:`tpinv.kernels.triton_attention_split`; needs every query row of a
    kv head in one row tile), one program per row tile (``False``), or by speed (``None``); a
    launch config other than the table's (16-bit inputs); the merging kernel even when the keys
    lie in one chunk (``True``; ``False`` needs them in one chunk); K/V blocks read through TMA
    descriptors (``None``: wherever :func:`kv_descriptors` can, ``True``: must, with one program
    per row tile; ``False``: pointer loads); the chunks-in-parallel launch as the Gluon kernel on
    an sm_90 GPU (``True``: must, with ``split``; ``False``: the Triton kernel; ``None``: by
    speed, :func:`~tpinv.kernels.triton_attention_split.decode_kernel_for`).
    """
    g = check_attention_inputs(q, k, v, q_pos, mask, causal, window)
    B, Hq, S, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    DP = padded_head_dim(D)
    scale = resolve_scale(scale, D)
    out = empty_in_layout_of(q)
    lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if T == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    if B * Hkv > 65535:
        raise ValueError(f"B * Hkv = {B * Hkv} exceeds the grid limit 65535; split the batch")
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    m, (s_mb, s_ms, s_mt) = mask_args(mask, q)
    single = one_chunk(T)
    if merge is None:
        merge = not single
    elif not merge and not single:
        raise ValueError(f"merge=False needs every key slot in the first chunk: T = {T} > "
                         f"{KV_BLOCK * KV_CHUNK_BLOCKS}")
    if config is not None and q.dtype == torch.float32:
        raise ValueError("attention_forward_cuda: config= is for bf16/fp16 inputs (fp32 has one shape)")
    cfg = config or forward_config(q.dtype, DP)
    n_tiles = cdiv(S * g, cfg.block_m)
    if gluon and (split is False or tma):
        raise ValueError("gluon=True is the chunks-in-parallel launch: it needs split and no tma")
    if split is None and tma:
        split = False
    if split is None and gluon:
        split = True
    if split is None:
        split = _split_module().use_split(B, Hkv, S * g, cfg.block_m, T, KV_BLOCK, KV_CHUNK_BLOCKS,
                                          DP)
    elif split and n_tiles > 1:
        raise ValueError(f"split=True needs every query row of a kv head in one row tile: "
                         f"S * g = {S * g} > {cfg.block_m}")
    if split and tma:
        raise ValueError("tma=True needs split=False: the chunks-in-parallel launch reads k/v "
                         "through pointer loads")
    if split:
        sp = _split_module()
        sp.split_forward_cuda(sp.SplitLaunch(q, k, v, q_pos, m, (s_mb, s_ms, s_mt), g, causal,
                                             window, scale, mask is not None, cfg, DP, KV_BLOCK,
                                             KV_CHUNK_BLOCKS), out, lse, gluon)
        return out, lse
    plan = attention_plan((operands_key(q, k, v, q_pos, m), bool(causal), window, cfg, bool(merge), tma))
    bound = plan.setdefault("forward", {})
    descs = kv_descriptors(k, v, KV_BLOCK, DP, kept_for(plan, bound)) if tma is not False else None
    if tma and descs is None:
        raise ValueError("tma=True: these k/v cannot be read through TMA descriptors")
    k_desc, v_desc = descs or (k, v)
    launch(_attn_fwd_kernel, (n_tiles, B * Hkv),
        q, k, v, k_desc, v_desc, q_pos, m, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), q_pos.stride(0), q_pos.stride(1),
        s_mb, s_ms, s_mt, out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        S, T, D, Hkv, n_tiles, int(window or 0), scale,
        G=g, CAUSAL=bool(causal), WINDOW=window is not None, HAS_MASK=mask is not None,
        BLOCK_M=cfg.block_m, KB=KV_BLOCK, DP=DP, CB=KV_CHUNK_BLOCKS, MERGE=bool(merge),
        TMA=descs is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=False, bound=bound)
    return out, lse
