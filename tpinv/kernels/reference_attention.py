"""Invariant attention forward on CPU: a query's output never depends on what runs beside it.

Fixed order, per query row (query head ``h`` uses kv head ``h // g``):

* score ``s_j = halving_sum_D(q * k_j) * scale`` (fp32 products, contiguous halving over
  the zero-padded head dim, the order of :func:`tpinv.kernels.reference_tree.halving_sum`);
* key slots are cut into blocks of ``KV_BLOCK`` slots starting at absolute slot 0,
  ``KV_BLOCK``, ``2*KV_BLOCK`` ... (slot ``j`` holds position ``j``) and visited in slot
  order by an online softmax: ``m' = max(m, max_block s)``, ``alpha = exp(m - m')``,
  ``l = l*alpha + halving_sum_block(exp(s - m'))``, ``o = o*alpha + halving_sum_block(p*v)``;
* ``out = o / l`` in fp32, then one rounding to the input dtype; ``lse = m + log(l)`` (fp32).

Keys a query may not see contribute exact zeros (whatever the slot holds, NaN included), a
block with no visible key leaves ``(m, l, o)`` unchanged (``alpha`` is exactly 1 there), and
zero padding of a halving sum is exact.  Hence the same bits in a full prefill, a chunked
prefill or a decode step against a KV cache, at any batch size or padding length, and
blocks no query of a call can see may be skipped.  Zeros are returned as ``+0``.

Positions are slots here (the block grid is absolute); for packed rows
:mod:`tpinv.kernels.reference_attention_packed` places keys by their own positions.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tpinv.core.contract import check_dtype

#: Key slots per online-softmax block; blocks start at absolute slots 0, KV_BLOCK, ...
KV_BLOCK = 64
#: Bytes of one intermediate tensor of a chunk: small, to stay in cache (speed only, never bits).
CHUNK_BYTES = 4 << 20
#: Most query rows per forward chunk (speed only: smaller chunks skip more causal blocks).
QUERY_CHUNK = 64

_NEG_INF = float("-inf")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def halve(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum ``dim`` by contiguous halving over a zero-padded power of two (removes ``dim``).

    The order of :func:`tpinv.kernels.reference_tree.halving_sum` (element ``i`` meets
    ``i + h``), applied in place along any dimension so the summed axis need not be last.
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    p = next_pow2(n)
    if p != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = p - n
        x = torch.cat([x, x.new_zeros(pad_shape)], dim)
    while x.shape[dim] > 1:
        h = x.shape[dim] // 2
        x = x.narrow(dim, 0, h) + x.narrow(dim, h, h)
    return x.squeeze(dim)


def all_finite(x: torch.Tensor) -> bool:
    """No inf/NaN in ``x`` (min and max are exact; NaN and inf reach them)."""
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                           mask: Optional[torch.Tensor], causal: bool,
                           window: Optional[int]) -> int:
    """Validate shapes, dtypes and options; return the GQA group size ``g = Hq // Hkv``."""
    for name, t in (("q", q), ("k", k), ("v", v), ("q_pos", q_pos)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, Hq, S, D], got {list(q.shape)}")
    B, Hq, S, D = q.shape
    check_dtype(q.dtype, "q")
    if k.dim() != 4 or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must have shape [B, Hkv, T, D] = [{B}, Hkv, T, {D}] "
                         f"(batch and head dim of q {list(q.shape)}), got {list(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k, {list(k.shape)}, got {list(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype; expected k and v in {q.dtype}, "
                        f"got k {k.dtype}, v {v.dtype}")
    Hkv, T = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q has Hq={Hq} heads, which is not a multiple of k's Hkv={Hkv} heads; "
                         f"expected Hq = g * Hkv (GQA), e.g. Hq={Hkv * max(1, Hq // max(Hkv, 1))}")
    if q_pos.dtype != torch.int64 or tuple(q_pos.shape) != (B, S):
        raise ValueError(f"q_pos must be an int64 tensor of shape [B, S] = [{B}, {S}], "
                         f"got {q_pos.dtype} {list(q_pos.shape)}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a bool tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool or tuple(mask.shape) != (B, S, T):
            raise ValueError(f"mask must be a bool tensor of shape [B, S, T] = [{B}, {S}, {T}] "
                             f"(True = may attend), got {mask.dtype} {list(mask.shape)}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int (keys p-window < j <= p) or None, "
                             f"got {window!r}")
        if not causal:
            raise ValueError("window needs causal=True (a sliding window looks back only)")
    devices = {t.device for t in (q, k, v, q_pos) + (() if mask is None else (mask,))}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, q_pos and mask must be on one device, "
                         f"got {sorted(map(str, devices))}")
    return Hq // Hkv


def kv_block_range(pos: torch.Tensor, T: int, causal: bool, window: Optional[int]) -> range:
    """Indices of the KV blocks that some query at ``pos`` may see (the rest are no-ops)."""
    if T == 0 or pos.numel() == 0:
        return range(0)
    hi = min(T, int(pos.max()) + 1) if causal else T
    lo = max(0, int(pos.min()) - window + 1) if window is not None else 0
    if hi <= lo:
        return range(0)
    return range(lo // KV_BLOCK, (hi - 1) // KV_BLOCK + 1)


def block_visibility(pos: torch.Tensor, j0: int, j1: int, causal: bool, window: Optional[int],
                     mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``[..., n_queries, j1 - j0]`` bool: may the query at ``pos[..., i]`` see key slot ``j``."""
    slots = torch.arange(j0, j1, dtype=torch.int64, device=pos.device)
    p = pos[..., None]
    vis = torch.ones((*pos.shape, j1 - j0), dtype=torch.bool, device=pos.device)
    if causal:
        vis &= slots <= p
    if window is not None:
        vis &= slots > p - window
    if mask is not None:
        vis &= mask
    return vis


def block_scores(q: torch.Tensor, k_blk: torch.Tensor, scale: float) -> torch.Tensor:
    """``[..., hc, g, n, D] x [..., hc, kb, D] -> [..., hc, g, n, kb]``, fp32.

    ``s = halving_sum_D(q * k) * scale``: products in fp32, halving over the head dim.
    """
    prod = q[..., :, None] * k_blk.transpose(-1, -2)[..., None, None, :, :]
    return halve(prod, -2) * scale


def _block_group(q, k, v, pos, mask, causal, window, scale, b0, b1, m, l, o, skip_blocks):
    """Blocks ``[b0, b1)`` of the online softmax, the heavy work vectorised over the blocks.

    The running max after each block is the ``cummax`` of the block maxima (exact), so
    ``alpha`` and ``p`` equal the block-by-block recurrence's; only ``l`` and ``o`` are
    then carried block by block, in slot order.  A partial last block is padded to
    ``KV_BLOCK`` with invisible slots (zero padding of a halving sum is exact).
    """
    T = k.shape[2]
    j0, j1 = b0 * KV_BLOCK, min(b1 * KV_BLOCK, T)
    vis = block_visibility(pos, j0, j1, causal, window, None if mask is None else mask[..., j0:j1])
    if skip_blocks and not bool(vis.any()):
        return m, l, o
    k_g, v_g = k[:, :, j0:j1].float(), v[:, :, j0:j1].float()
    pad = (b1 - b0) * KV_BLOCK - (j1 - j0)
    if pad:
        vis = torch.nn.functional.pad(vis, (0, pad), value=False)
        k_g = torch.nn.functional.pad(k_g, (0, 0, 0, pad))
        v_g = torch.nn.functional.pad(v_g, (0, 0, 0, pad))
    vis = vis.unflatten(-1, (b1 - b0, KV_BLOCK))[:, None, None]  # [bc, 1, 1, n, nb, KV_BLOCK]
    s = torch.where(vis, block_scores(q, k_g, scale).unflatten(-1, (b1 - b0, KV_BLOCK)), _NEG_INF)
    m_run = torch.cummax(torch.cat([m[..., None], torch.amax(s, dim=-1)], -1), dim=-1).values
    m_prev, m_new = m_run[..., :-1], m_run[..., 1:]
    m_safe = torch.where(m_new == _NEG_INF, 0.0, m_new)
    alpha = torch.where(m_new == m_prev, 1.0, torch.exp(m_prev - m_safe))
    p = torch.exp(s - m_safe[..., None])
    block_l = halve(p, -1)
    pv = p[..., None] * v_g.unflatten(2, (b1 - b0, KV_BLOCK))[:, :, None, None]
    if not all_finite(v_g):  # 0 * inf/NaN in a slot a query cannot see
        pv = torch.where(vis[..., None], pv, 0.0)
    block_o = halve(pv, -2)
    for i in range(b1 - b0):
        l = l * alpha[..., i] + block_l[..., i]
        o = o * alpha[..., i, None] + block_o[..., i, :]
    return m_run[..., -1], l, o


def _forward_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                  mask: Optional[torch.Tensor], causal: bool, window: Optional[int], scale: float,
                  skip_blocks: bool, chunk_bytes: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online softmax of one chunk: q [bc, hc, g, n, D] fp32; k, v [bc, hc, T, D] (any float
    dtype); pos [bc, n]; mask [bc, n, T] or None.

    Returns fp32 ``(o, l, m)``: unnormalised output, softmax sum and running max.  Blocks
    are shared by the chunk's rows (a block a row cannot see is an exact no-op for it) and
    taken in groups that fit ``chunk_bytes``.
    """
    T = k.shape[2]
    m = q.new_full(q.shape[:-1], _NEG_INF)
    l = q.new_zeros(q.shape[:-1])
    o = q.new_zeros(q.shape)
    blocks = kv_block_range(pos, T, causal, window) if skip_blocks else range(-(-T // KV_BLOCK))
    per_block = q[..., 0].numel() * KV_BLOCK * next_pow2(q.shape[-1]) * 4
    group = max(1, chunk_bytes // per_block)
    for b0 in range(blocks.start, blocks.stop, group):
        m, l, o = _block_group(q, k, v, pos, mask, causal, window, scale, b0,
                               min(blocks.stop, b0 + group), m, l, o, skip_blocks)
    return o, l, m


def _rows_per_chunk(D: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (KV_BLOCK * next_pow2(D) * 4))


def grouped_buffers(q: torch.Tensor, k: torch.Tensor, g: int, scale: Optional[float]):
    """``(scale, qg, out, lse)`` of a forward: the default scale, q viewed as ``[B, Hkv, g, S, D]``
    (query heads grouped by their KV head) and the output and log-sum-exp buffers in that view."""
    B, _, S, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.empty((B, Hkv, g, S, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hkv, g, S), dtype=torch.float32, device=q.device)
    return scale, q.reshape(B, Hkv, g, S, D), out, lse


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      mask: Optional[torch.Tensor] = None, causal: bool = True,
                      window: Optional[int] = None, scale: Optional[float] = None, *,
                      chunk_bytes: int = CHUNK_BYTES, query_chunk: int = QUERY_CHUNK,
                      skip_blocks: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Invariant attention: ``(out [B, Hq, S, D] in q.dtype, lse [B, Hq, S] fp32)``.

    ``chunk_bytes``, ``query_chunk`` and ``skip_blocks`` change speed and memory only,
    never the bits.  A query that sees no key gets ``out = 0`` and ``lse = -inf``; one that sees a
    NaN key gets NaN ``out`` and ``lse`` (as in PyTorch's attention).
    """
    g = check_attention_inputs(q, k, v, q_pos, mask, causal, window)
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    scale, qg, out, lse = grouped_buffers(q, k, g, scale)
    rows = _rows_per_chunk(D, chunk_bytes)
    n_q = max(1, min(S, query_chunk, rows // g))
    n_h = max(1, min(Hkv, rows // (g * n_q)))
    n_b = max(1, min(B, rows // (g * n_q * Hkv))) if n_h == Hkv else 1
    for b0 in range(0, B, n_b):
        b1 = min(B, b0 + n_b)
        for s0 in range(0, S, n_q):
            s1 = min(S, s0 + n_q)
            pos = q_pos[b0:b1, s0:s1]
            mask_c = None if mask is None else mask[b0:b1, s0:s1]
            for h0 in range(0, Hkv, n_h):
                h1 = min(Hkv, h0 + n_h)
                q_c = qg[b0:b1, h0:h1, :, s0:s1].float()
                o, l, m = _forward_rows(q_c, k[b0:b1, h0:h1], v[b0:b1, h0:h1], pos, mask_c,
                                        causal, window, scale, skip_blocks, chunk_bytes)
                seen = l != 0  # 0: no visible key; NaN (a NaN key or value seen) propagates as in PyTorch
                l_safe = torch.where(seen, l, 1.0)
                res = torch.where(seen[..., None], o / l_safe[..., None], 0.0)
                out[b0:b1, h0:h1, :, s0:s1] = (res + 0.0).to(q.dtype)
                lse[b0:b1, h0:h1, :, s0:s1] = torch.where(seen, m + torch.log(l_safe), _NEG_INF)
    return out.reshape(B, Hq, S, D), lse.reshape(B, Hq, S)
