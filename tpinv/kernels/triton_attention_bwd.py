"""Invariant attention backward on CUDA (Triton): deterministic, no atomics, fixed orders.

With ``p = exp(s - lse)`` recomputed from the forward's score ``s = dot(q, k) * scale``,
``dP = dot(dO, v)``, ``Delta = sum_D(dO * out) - dlse`` and ``dS = p * (dP - Delta)``
(exact zeros where a key is not visible), three kernels:

* ``Delta``: one row per lane, the head dim summed by contiguous halving over the
  zero-padded power of two (element ``i`` meets ``i + h``), the CPU kernel's order;
* ``dK, dV`` (:mod:`tpinv.kernels.triton_attention_dkdv`): one program per (KV block of
  ``KV_BLOCK`` slots, batch row, kv head) walks the tiles of the flattened interleaved rows
  ``r = s * g + hg`` (all ``g`` query heads of the kv head together) in increasing order: ``dV += p^T dO``, ``dK += dS^T q`` in fp32
  (times ``scale`` at the end).  ``p^T`` and ``dS^T`` are computed slot-major, from
  ``k q^T`` and ``v dO^T``, so they feed the next dots from registers as they are; each of
  their elements is the same dot product as in ``q k^T``.  Only tiles between the first and
  the last row that may see the block are visited; the others would add exact zeros.  Tiles
  whose rows all see the whole block skip the visibility test (the same values).  Rows
  appended after a request (right padding: zero ``dO`` and ``dlse``) add exact zeros, so a
  request's dK/dV are the same bits alone or padded, at any batch size; tensor parallelism
  splits kv heads, never the ``g`` rows of one, so the sums are the same at any TP size;
* ``dQ``: one program per row tile (the forward's tiling and config) walks the KV blocks
  in slot order from absolute slot 0: ``dQ += dS k`` (times ``scale``), so a query's
  gradient does not depend on what else is in the call.

Launch shapes (:class:`BackwardConfig`, one per dtype and padded head dim, never a function of
B, S or T).  Every sum here reduces over rows (dK, dV) or over key slots (dQ) with a fixed
per-row ``p = exp(s - lse)`` -- no running max -- through dots that accumulate into the running
fp32 tile, and the tensor cores chain a dot's k16 steps in increasing k whatever the tile (the
``BLOCK_K`` probe of ``docs/gpu-matmul-notes.md``); rows or slots outside the visible span add
exact zeros.  So the slots a dK/dV program owns, the rows it takes per step, the rows a dQ
program owns and the slots it takes per step are meant as speed choices -- but that rests on
how Triton lowers each tile, so only shapes checked on the device to give the table's bytes
are listed (:data:`BACKWARD_CANDIDATES`, all run by ``tests/gpu/test_triton_attention.py``).
The kernel before the slot-major one transposed ``p`` and ``dS`` in registers and, in some
shapes, gave one head a wrong dK that changed from call to call (``docs/benchmarks.md``); the
GPU tests now bound every head's error and repeat each call.

The dQ kernel reads K/V blocks, and both kernels the interleaved ``q``/``dO`` rows, through TMA
descriptors wherever one can (:mod:`tpinv.kernels.triton_attention_tma`: the same tiles, the same
bits); the dK/dV kernel only without a window or a mask: with either, ptxas 12.8 (Triton 3.6's)
crashed compiling it, so those take its pointer loads.

Slots no row of a dQ tile may see are zeroed before ``dS k`` (``0 * NaN`` cannot leak);
the dK/dV kernel masks ``p`` and ``dS`` so junk in a slot reaches only that slot's zero
gradient.  ``q`` and ``grad_out`` must be finite on every row.  Semantics are those of
:mod:`tpinv.kernels.reference_attention_bwd`; bits differ from the CPU kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from tpinv.kernels.launch import cdiv, launch, operands_key
from tpinv.kernels.layout import empty_in_layout_of
from tpinv.kernels.reference_attention import KV_BLOCK, check_attention_inputs
from tpinv.kernels.reference_attention_bwd import check_backward_inputs
from tpinv.kernels.triton_attention import last_dim_contiguous, mask_args, padded_head_dim, resolve_scale
from tpinv.kernels.triton_attention_dkdv import dkdv_kernel
from tpinv.kernels.triton_attention_tiles import (block_ranges, clean_kv, load_kv_blocks, poison_rows,
                                                  query_tile, visibility)
from tpinv.kernels.triton_attention_tma import (attention_plan, kept_for, kv_descriptors, load_kv_tma,
                                                row_descriptor)

__all__ = ["attention_backward_cuda", "BackwardConfig", "backward_config", "BACKWARD_CANDIDATES",
           "DELTA_ROWS", "POS_SCAN"]


@dataclass(frozen=True)
class BackwardConfig:
    """Launch shapes of the dK/dV and dQ kernels (speed only, each checked on the device: module docstring)."""

    dkdv_slots: int     # key slots a dK/dV program owns
    dkdv_rows: int      # query rows per step of its walk
    dkdv_warps: int
    dkdv_stages: int
    dq_rows: int        # query rows a dQ program owns
    dq_slots: int       # key slots per step of its walk
    dq_warps: int
    dq_stages: int


#: fp32 runs the exact FMA dots (no tensor cores, no pipeline: shared memory).
_FP32_BACKWARD = BackwardConfig(KV_BLOCK, 32, 4, 1, 32, KV_BLOCK, 4, 1)
#: 16-bit inputs, per padded head dim.
_BACKWARD_TABLE = {
    16: BackwardConfig(KV_BLOCK, 64, 4, 2, 64, KV_BLOCK, 4, 3),
    32: BackwardConfig(KV_BLOCK, 64, 4, 2, 64, KV_BLOCK, 4, 3),
    64: BackwardConfig(KV_BLOCK, 64, 4, 2, 64, KV_BLOCK, 4, 3),
    128: BackwardConfig(KV_BLOCK, 32, 4, 3, 64, 32, 4, 3),    # 1.33-1.38x the shape before (H200)
    256: BackwardConfig(KV_BLOCK, 64, 8, 2, 64, KV_BLOCK, 8, 2),
}
#: Launch shapes for 16-bit inputs checked on the device (an H200, bf16, head dim 128, GQA 1, 2 and
#: 4) to give the table's bytes; the GPU tests run each beside the table's.
BACKWARD_CANDIDATES = (
    BackwardConfig(KV_BLOCK, 64, 4, 2, 64, KV_BLOCK, 4, 3),
    BackwardConfig(KV_BLOCK, 16, 4, 3, 64, KV_BLOCK, 4, 3),
    BackwardConfig(128, 32, 8, 3, 64, KV_BLOCK, 4, 3),
    BackwardConfig(128, 64, 8, 2, 128, 32, 8, 3),
    BackwardConfig(KV_BLOCK, 32, 4, 3, 64, 16, 4, 3),
)


def backward_config(dtype: torch.dtype, DP: int) -> BackwardConfig:
    """The table's launch shapes for ``dtype`` and padded head dim ``DP`` (nothing else)."""
    return _FP32_BACKWARD if dtype == torch.float32 else _BACKWARD_TABLE[DP]


#: Rows per program of the Delta kernel (speed only: each row is reduced on its own).
DELTA_ROWS = 32
#: Positions read per step when the dK/dV kernel looks for the rows that may see its block.
POS_SCAN = 1024


@triton.jit
def _delta_kernel(do_ptr, o_ptr, dlse_ptr, delta_ptr, s_db, s_dh, s_ds, s_ob, s_oh, s_os,
                  s_gb, s_gh, s_gs, s_xb, s_xh, S, D, Hq,
                  HAS_DLSE: tl.constexpr, ROWS: tl.constexpr, DP: tl.constexpr,
                  LOG2_DP: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = (bh % Hq).to(tl.int64)
    s = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    ok = s < S
    offs_d = tl.arange(0, DP)
    ok2 = ok[:, None] & (offs_d < D)[None, :]
    do = tl.load(do_ptr + b * s_db + h * s_dh + s[:, None] * s_ds + offs_d[None, :], mask=ok2,
                 other=0.0).to(tl.float32)
    o = tl.load(o_ptr + b * s_ob + h * s_oh + s[:, None] * s_os + offs_d[None, :], mask=ok2,
                other=0.0).to(tl.float32)
    x = do * o
    for i in tl.static_range(LOG2_DP):  # contiguous halving: element j meets j + width/2
        x = tl.sum(tl.reshape(x, [ROWS, 2, DP >> (i + 1)]), axis=1)
    delta = tl.reshape(x, [ROWS])
    if HAS_DLSE:
        delta = delta - tl.load(dlse_ptr + b * s_gb + h * s_gh + s * s_gs, mask=ok, other=0.0)
    tl.store(delta_ptr + b * s_xb + h * s_xh + s, delta, mask=ok)


@triton.jit
def _dq_block(dq, q, do, lse, delta, k_base, v_base, s_kt, s_vt, blk, pos, valid, mask_row_ptr,
              s_mt, T, D, window, scale, k_desc, v_desc, b32, hk32, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, KB: tl.constexpr,
              DP: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        slots, k, v = load_kv_tma(k_desc, v_desc, b32, hk32, blk, KB, DP)
    else:
        slots, k, v = load_kv_blocks(k_base, v_base, s_kt, s_vt, blk, T, D, KB, DP)
    if MASKED:
        vis = visibility(pos, valid, slots, T, window, mask_row_ptr, s_mt, CAUSAL, WINDOW,
                         HAS_MASK)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        v, k, bad = clean_kv(vis, v, k)
        p = tl.where(vis, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
        dq = poison_rows(dq, vis, bad)
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
    return dq


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, q_desc, do_desc, do_ptr, lse_ptr, delta_ptr,
               qpos_ptr, mask_ptr, dq_ptr,
               s_qb, s_qh, s_qs, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_db, s_dh, s_ds,
               s_lb, s_lh, s_ls, s_xb, s_xh, s_pb, s_ps, s_mb, s_ms, s_mt, s_gb, s_gh, s_gs,
               S, T, D, Hkv, n_tiles, window, scale, G: tl.constexpr, CAUSAL: tl.constexpr,
               WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
               KB: tl.constexpr, DP: tl.constexpr, TMA: tl.constexpr):
    tile = n_tiles - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b32 = bh // Hkv
    hk32 = bh % Hkv
    b = (bh // Hkv).to(tl.int64)
    hk = (bh % Hkv).to(tl.int64)
    valid, pos, head, s64, q, do, lse, delta = query_tile(
        tile, b, hk, qpos_ptr, q_ptr, do_ptr, lse_ptr, delta_ptr, s_pb, s_ps, s_qb, s_qh, s_qs, s_db,
        s_dh, s_ds, s_lb, s_lh, s_ls, s_xb, s_xh, S, D, q_desc, do_desc, G, BLOCK_M, DP, TMA)
    offs_d = tl.arange(0, DP)
    k_base = k_ptr + b * s_kb + hk * s_kh
    v_base = v_ptr + b * s_vb + hk * s_vh
    mrow = mask_ptr + b * s_mb + s64 * s_ms
    lo, f_lo, f_hi, hi = block_ranges(pos, valid, T, window, CAUSAL, WINDOW, HAS_MASK, KB)
    dq = tl.zeros([BLOCK_M, DP], tl.float32)
    if WINDOW:
        for blk in range(lo, f_lo):
            dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, s_kt, s_vt, blk, pos, valid,
                           mrow, s_mt, T, D, window, scale, k_desc, v_desc, b32, hk32, True, CAUSAL,
                           WINDOW, HAS_MASK, KB, DP, TMA)
    for blk in range(f_lo, f_hi):
        dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, s_kt, s_vt, blk, pos, valid, mrow,
                       s_mt, T, D, window, scale, k_desc, v_desc, b32, hk32, False, CAUSAL, WINDOW,
                       HAS_MASK, KB, DP, TMA)
    for blk in range(f_hi, hi):
        dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, s_kt, s_vt, blk, pos, valid, mrow,
                       s_mt, T, D, window, scale, k_desc, v_desc, b32, hk32, True, CAUSAL, WINDOW,
                       HAS_MASK, KB, DP, TMA)
    tl.store((dq_ptr + b * s_gb + head * s_gh + s64 * s_gs)[:, None] + offs_d[None, :],
             (dq * scale + 0.0).to(dq_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_d < D)[None, :])


def _check_backward_inputs(grad_out, grad_lse, q, out, lse) -> None:
    """The CPU kernel's checks, and one more: the kernels read ``grad_out``/``out`` as q's dtype."""
    check_backward_inputs(grad_out, grad_lse, q, out, lse)
    if grad_out.dtype != q.dtype or out.dtype != q.dtype:
        raise TypeError(f"grad_out and out must be {q.dtype} like q, "
                        f"got {grad_out.dtype} and {out.dtype}")


def attention_backward_cuda(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor],
                            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            lse: torch.Tensor, q_pos: torch.Tensor,
                            mask: Optional[torch.Tensor] = None, causal: bool = True,
                            window: Optional[int] = None, scale: Optional[float] = None, *,
                            grad_kv_dtype: Optional[torch.dtype] = None,
                            config: Optional[BackwardConfig] = None, tma: Optional[bool] = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``tpinv::attention`` (dtypes of ``q, k, v``); ``grad_lse`` may be
    None (zeros).  ``grad_kv_dtype`` stores dK and dV in that dtype instead (the same fp32
    sums, rounded once to it: fp32 keeps them unrounded for a caller that adds them up).
    ``config``: launch shapes other than the table's (the same bits; 16-bit inputs only).
    ``tma``: the kernels read q, grad_out (and the dQ kernel K and V) through TMA descriptors
    (``None``: where they can, ``True``: must, ``False``: pointer loads) -- the same tiles,
    the same bits."""
    g = check_attention_inputs(q, k, v, q_pos, mask, causal, window)
    _check_backward_inputs(grad_out, grad_lse, q, out, lse)
    B, Hq, S, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    DP = padded_head_dim(D)
    scale = resolve_scale(scale, D)
    # every element is stored by the kernels below (dK/dV: every slot of every program; dQ: every
    # row of every tile, zeros where no key is visible), so no zero fill -- except with no keys
    dq = empty_in_layout_of(q)
    dk = empty_in_layout_of(k, grad_kv_dtype or k.dtype)
    dv = empty_in_layout_of(v, grad_kv_dtype or v.dtype)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if B * Hq > 65535:
        raise ValueError(f"B * Hq = {B * Hq} exceeds the grid limit 65535; split the batch")
    q, k, v, grad_out, out = (last_dim_contiguous(t) for t in (q, k, v, grad_out, out))
    m, (s_mb, s_ms, s_mt) = mask_args(mask, q)
    delta = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    dlse = grad_lse if grad_lse is not None else delta
    if config is None:
        config = backward_config(q.dtype, DP)
    elif q.dtype == torch.float32:
        raise ValueError("attention_backward_cuda: config= is for bf16/fp16 inputs (fp32 has one shape)")
    plan = attention_plan((operands_key(q, k, v, grad_out, out, lse, q_pos, m),
                           None if grad_lse is None else operands_key(grad_lse), bool(causal), window,
                           grad_kv_dtype, config, tma))
    launch(_delta_kernel, (cdiv(S, DELTA_ROWS), B * Hq),
        grad_out, out, dlse, delta, *grad_out.stride()[:3], *out.stride()[:3], *dlse.stride(),
        delta.stride(0), delta.stride(1), S, D, Hq,
        HAS_DLSE=grad_lse is not None, ROWS=DELTA_ROWS, DP=DP,
        LOG2_DP=DP.bit_length() - 1, num_warps=4, enable_fp_fusion=False, bound=plan.setdefault("delta", {}))
    common = dict(G=g, CAUSAL=bool(causal), WINDOW=window is not None, HAS_MASK=mask is not None, DP=DP)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3],
               *lse.stride(), delta.stride(0), delta.stride(1), *q_pos.stride(), s_mb, s_ms, s_mt)
    rows = None
    bound = plan.setdefault("dkdv", {})
    if tma is not False and window is None and mask is None:   # ptxas crashed on the others
        kept = kept_for(plan, bound)
        rows = (row_descriptor(q, g, config.dkdv_rows, DP, kept, "q"),
                row_descriptor(grad_out, g, config.dkdv_rows, DP, kept, "grad_out"))
        rows = None if any(r is None for r in rows) else rows
    if tma and rows is None:
        raise ValueError("tma=True: the dK/dV kernel cannot read these q/grad_out through TMA "
                         "descriptors (or a window or mask is set)")
    launch(dkdv_kernel, (cdiv(T, config.dkdv_slots), B * Hkv),
        q, k, v, grad_out, *(rows or (q, grad_out)), lse, delta, q_pos, m, dk, dv, *strides, *dk.stride()[:3],
        *dv.stride()[:3], S, T, D, Hkv, int(window or 0), scale, BLOCK_M=config.dkdv_rows,
        KB=config.dkdv_slots, SCAN=POS_SCAN, TMA=rows is not None, num_warps=config.dkdv_warps,
        num_stages=config.dkdv_stages, enable_fp_fusion=False, bound=bound, **common)
    n_tiles = cdiv(S * g, config.dq_rows)
    bound = plan.setdefault("dq", {})
    kept = kept_for(plan, bound)
    descs = kv_descriptors(k, v, config.dq_slots, DP, kept) if tma is not False else None
    rows = (row_descriptor(q, g, config.dq_rows, DP, kept, "q"),
            row_descriptor(grad_out, g, config.dq_rows, DP, kept, "grad_out"))
    descs = None if descs is None or any(r is None for r in rows) else (*descs, *rows)
    if tma and descs is None:
        raise ValueError("tma=True: these k/v cannot be read through TMA descriptors")
    launch(_dq_kernel, (n_tiles, B * Hkv),
        q, k, v, *(descs or (k, v, q, grad_out)), grad_out, lse, delta, q_pos, m, dq, *strides,
        *dq.stride()[:3],
        S, T, D, Hkv, n_tiles, int(window or 0), scale, BLOCK_M=config.dq_rows, KB=config.dq_slots,
        TMA=descs is not None, num_warps=config.dq_warps, num_stages=config.dq_stages,
        enable_fp_fusion=False, bound=bound, **common)
    return dq, dk, dv
