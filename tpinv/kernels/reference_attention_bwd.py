"""Invariant attention backward on CPU: fixed orders over keys, queries and the GQA group.

With ``p = exp(s - lse)`` recomputed blockwise (the forward's scores, same bits),
``dP_ij = halving_sum_D(dO_i * v_j)``, ``Delta_i = halving_sum_D(dO_i * out_i) - dlse_i``
and ``dS = p * (dP - Delta)`` (exact zeros where a key is not visible):

* ``dQ_i = scale * sum over KV blocks, in slot order, of halving_sum_block(dS_ij * k_j)``
  (the forward's absolute block grid, so a query's gradient does not depend on the call);
* ``dV_j = halving_sum_group(halving_sum_S(p_ij * dO_i))`` and
  ``dK_j = scale * halving_sum_group(halving_sum_S(dS_ij * q_i))``: contiguous halving
  over the call's query axis (zero-padded to a power of two) and then over the ``g``
  query heads of the kv head.  Queries appended after a request (right padding, no
  visible key or zero ``dO``) add exact zeros, so a request's gradients are the same bits
  alone or inside a padded batch.

Memory is bounded by cutting the padded query axis into ``n_c`` (a power of two)
*strided* chunks ``c::n_c``: halving over the whole axis equals halving each strided
chunk and then halving the ``n_c`` partials in chunk order, so chunking never changes bits.
All sums in fp32; each gradient is rounded once; zeros are returned as ``+0``.
The inputs ``q`` and ``dO`` must be finite on every row (padding rows included).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tpinv.kernels.reference_attention import (CHUNK_BYTES, KV_BLOCK, all_finite, block_scores,
                                         block_visibility, check_attention_inputs, halve,
                                         kv_block_range, next_pow2)

_NEG_INF = float("-inf")


def check_backward_inputs(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor],
                           q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    B, Hq, S, _ = q.shape
    if grad_out.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"grad_out and out must have q's shape {list(q.shape)}, "
                         f"got {list(grad_out.shape)} and {list(out.shape)}")
    for name, t in (("lse", lse), ("grad_lse", grad_lse)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (B, Hq, S)):
            raise ValueError(f"{name} must be fp32 of shape [B, Hq, S] = [{B}, {Hq}, {S}], "
                             f"got {t.dtype} {list(t.shape)}")


def _pad_rows(x: torch.Tensor, n: int, dim: int, value: float = 0.0) -> torch.Tensor:
    """Append rows of ``value`` along ``dim`` up to length ``n``."""
    extra = n - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim)


def _chunking(Hkv: int, g: int, P: int, D: int, chunk_bytes: int) -> tuple[int, int]:
    """``(kv heads per chunk, number of strided query chunks)`` within ``chunk_bytes``."""
    rows = max(1, chunk_bytes // (KV_BLOCK * next_pow2(D) * 4))
    if g * P <= rows:
        return max(1, min(Hkv, rows // (g * P))), 1
    return 1, min(P, next_pow2(-(-g * P // rows)))


def halve_span(x: torch.Tensor, start: int, n: int, dim: int) -> torch.Tensor:
    """:func:`halve` over a length-``n`` (power of two) zero vector holding ``x`` from ``start``.

    Only the span is materialised: a zero partner is never added (``x + 0 = x``), so the
    result equals ``halve`` of the zero-filled vector up to the sign of an all-zero sum.
    """
    dim = dim % x.dim()
    if start < 0 or start + x.shape[dim] > n:
        raise ValueError(f"span [{start}, {start + x.shape[dim]}) does not fit in length {n}")
    while n > 1 and x.shape[dim] > 0:
        h = n // 2
        end = start + x.shape[dim]
        if end <= h:  # the upper half is zero
            n = h
            continue
        if start >= h:  # the lower half is zero
            start, n = start - h, h
            continue
        lower = x.narrow(dim, 0, h - start)  # slots [start, h)
        upper = x.narrow(dim, h - start, end - h)  # slots [h, end), paired with [0, end - h)
        if start == 0 and end == n:
            x = lower + upper
        else:
            shape = list(x.shape)
            shape[dim] = h
            y = x.new_zeros(shape)
            y.narrow(dim, 0, end - h).copy_(upper)
            y.narrow(dim, start, h - start).add_(lower)
            x = y
        start, n = 0, h
    if x.shape[dim] == 0:
        shape = list(x.shape)
        del shape[dim]
        return x.new_zeros(shape)
    return x.squeeze(dim)


def _head_chunk_backward(q, k, v, do, delta, lse, pos, valid, mask, causal, window, scale,
                         n_c, skip_blocks):
    """One batch row, ``hc`` kv heads: fp32 ``(dq [hc, g, P, D], dk, dv [hc, T, D])``.

    ``q, do`` are ``[hc, g, P, D]`` fp32, ``delta, lse`` ``[hc, g, P]``; rows ``>= S`` are
    padding (``valid`` False).  Strided chunk ``c`` holds rows ``c, c + n_c, ...``; within
    it only the span from the first to the last row that sees the block is computed
    (the rows outside add exact zeros) unless ``skip_blocks`` is False.
    """
    hc, g, P, D = q.shape
    T = k.shape[1]
    P_c = P // n_c
    dq = torch.zeros_like(q)
    dk = q.new_zeros((hc, T, D))
    dv = q.new_zeros((hc, T, D))
    blocks = (kv_block_range(pos[valid], T, causal, window) if skip_blocks
              else range(-(-T // KV_BLOCK)))
    for blk in blocks:
        j0, j1 = blk * KV_BLOCK, min((blk + 1) * KV_BLOCK, T)
        k_blk = k[:, j0:j1].float()
        v_blk = v[:, j0:j1].float()
        k_finite = all_finite(k_blk)
        dk_parts, dv_parts = [], []
        for c in range(n_c):
            chunk = slice(c, P, n_c)
            vis = block_visibility(pos[chunk], j0, j1, causal, window,
                                   None if mask is None else mask[chunk, j0:j1])
            vis &= valid[chunk, None]
            r, e = 0, P_c
            if skip_blocks:
                live = vis.any(-1).nonzero()
                if live.numel() == 0:
                    dk_parts.append(q.new_zeros((hc, g, j1 - j0, D)))
                    dv_parts.append(q.new_zeros((hc, g, j1 - j0, D)))
                    continue
                r, e = int(live[0]), int(live[-1]) + 1
            rows = slice(c + r * n_c, c + (e - 1) * n_c + 1, n_c)
            vis = vis[r:e]
            q_c, do_c = q[:, :, rows], do[:, :, rows]
            s = block_scores(q_c, k_blk, scale)
            p = torch.where(vis, torch.exp(s - lse[:, :, rows, None]), 0.0)
            dp = halve(do_c[..., :, None] * v_blk.transpose(-1, -2)[:, None, None], -2)
            ds = torch.where(vis, p * (dp - delta[:, :, rows, None]), 0.0)
            dv_parts.append(halve_span(p[..., None] * do_c[..., None, :], r, P_c, -3))
            dk_parts.append(halve_span(ds[..., None] * q_c[..., None, :], r, P_c, -3))
            dsk = ds[..., None] * k_blk[:, None, None]
            if not k_finite:  # 0 * inf/NaN in a slot the query cannot see
                dsk = torch.where(vis[..., None], dsk, 0.0)
            dq[:, :, rows] += halve(dsk, -2)
        dk[:, j0:j1] = halve(halve(torch.stack(dk_parts), 0), 1)
        dv[:, j0:j1] = halve(halve(torch.stack(dv_parts), 0), 1)
    return dq, dk, dv


def attention_backward(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       q_pos: torch.Tensor, mask: Optional[torch.Tensor] = None,
                       causal: bool = True, window: Optional[int] = None,
                       scale: Optional[float] = None, *, chunk_bytes: int = CHUNK_BYTES,
                       skip_blocks: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`~tpinv.kernels.reference_attention.attention_forward`.

    ``out`` and ``lse`` are that forward's results; ``grad_lse`` (or None) is the
    gradient reaching ``lse``.  ``chunk_bytes`` and ``skip_blocks`` change speed and
    memory only, never the bits.
    """
    g = check_attention_inputs(q, k, v, q_pos, mask, causal, window)
    check_backward_inputs(grad_out, grad_lse, q, out, lse)
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    P = next_pow2(S)
    n_h, n_c = _chunking(Hkv, g, P, D, chunk_bytes)
    qg, dog, outg = (t.reshape(B, Hkv, g, S, D) for t in (q, grad_out, out))
    lseg = lse.reshape(B, Hkv, g, S)
    dlseg = None if grad_lse is None else grad_lse.reshape(B, Hkv, g, S)
    dq = torch.empty((B, Hkv, g, S, D), dtype=q.dtype, device=q.device)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    valid = torch.arange(P, device=q.device) < S
    for b in range(B):
        pos = _pad_rows(q_pos[b], P, 0, 0)
        mask_b = None if mask is None else _pad_rows(mask[b], P, 0, False)
        for h0 in range(0, Hkv, n_h):
            h1 = min(Hkv, h0 + n_h)
            do_h = dog[b, h0:h1].float()
            delta = halve(do_h * outg[b, h0:h1].float(), -1)
            if dlseg is not None:
                delta = delta - dlseg[b, h0:h1]
            dq_h, dk_h, dv_h = _head_chunk_backward(
                _pad_rows(qg[b, h0:h1].float(), P, 2), k[b, h0:h1], v[b, h0:h1],
                _pad_rows(do_h, P, 2), _pad_rows(delta, P, 2), _pad_rows(lseg[b, h0:h1], P, 2),
                pos, valid, mask_b, causal, window, scale, n_c, skip_blocks)
            dq[b, h0:h1] = (dq_h[:, :, :S] * scale + 0.0).to(q.dtype)
            dk[b, h0:h1] = (dk_h * scale + 0.0).to(k.dtype)
            dv[b, h0:h1] = (dv_h + 0.0).to(v.dtype)
    return dq.reshape(B, Hq, S, D), dk, dv
