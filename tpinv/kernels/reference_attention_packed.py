"""Invariant attention over packed rows: the key-block grid follows each key's own position.

With ``k_pos [B, T]`` (the position of the token in key slot ``j``), a query at position
``p`` sees key ``j`` when ``k_pos[j] <= p`` (causal), ``k_pos[j] > p - window`` (window)
and ``mask[i, j]``.  Every query then runs the online softmax of
:mod:`tpinv.kernels.reference_attention` over a *virtual* row in which the keys it sees sit
at slots equal to their positions: blocks of ``KV_BLOCK`` start at positions 0,
``KV_BLOCK``, ... of the query's own document, not at the packed row's slot 0.  Hence a
document packed at any offset of a row (with a mask that hides the other documents), or a
turn of a conversation packed with a 2D visibility mask and its own position ids, gives the
bits of the same tokens run alone (``k_pos`` = ``arange``), forward and backward.

The keys one query sees must have distinct positions (checked).  In the backward, key
``j``'s gradient is a halving sum over a virtual query axis on which query ``i`` sits at
slot ``q_pos[i]`` (so the sum does not depend on where the document was packed); queries
of a row that share a position (two contexts of a conversation) are laid on successive
layers of that axis, ``q_pos + r * Pq`` for the ``r``-th such query in row order.
All sums in fp32 in the orders of the slot-grid kernels; zeros are returned as ``+0``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tpinv.core.capture import value_range
from tpinv.kernels.reference_attention import (CHUNK_BYTES, KV_BLOCK, _forward_rows, all_finite,
                                               check_attention_inputs, grouped_buffers, halve, next_pow2)

_NEG_INF = float("-inf")


def check_key_positions(k_pos: torch.Tensor, k: torch.Tensor) -> None:
    """``k_pos`` must be a non-negative int64 ``[B, T]`` tensor on k's device."""
    B, _, T, _ = k.shape
    if not isinstance(k_pos, torch.Tensor) or k_pos.dtype != torch.int64 or tuple(k_pos.shape) != (B, T):
        got = f"{k_pos.dtype} {list(k_pos.shape)}" if isinstance(k_pos, torch.Tensor) else type(k_pos).__name__
        raise ValueError(f"k_pos must be an int64 tensor of shape [B, T] = [{B}, {T}], got {got}")
    if k_pos.device != k.device:
        raise ValueError(f"k_pos must be on k's device {k.device}, got {k_pos.device}")
    bounds = value_range(k_pos)   # None for a fake k_pos: the kernel's entry check reads the values
    if bounds is not None and bounds[0] < 0:
        raise ValueError(f"k_pos must be non-negative, got min {bounds[0]}")


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, mask: Optional[torch.Tensor], causal: bool,
            window: Optional[int]) -> torch.Tensor:
    """``[..., S, T]`` bool: may the query at ``q_pos[..., i]`` see the key at ``k_pos[..., j]``
    (one row: ``q_pos [S]``, ``k_pos [T]``; or rows: ``[B, S]``, ``[B, T]``)."""
    vis = torch.ones((*q_pos.shape, k_pos.shape[-1]), dtype=torch.bool, device=q_pos.device)
    if causal:
        vis &= k_pos[..., None, :] <= q_pos[..., :, None]
    if window is not None:
        vis &= k_pos[..., None, :] > q_pos[..., :, None] - window
    if mask is not None:
        vis &= mask
    return vis


def virtual_slots(vis: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``[S, Tv]`` int64: the key slot query ``i`` sees at position ``p`` (``-1``: none).

    Raises when a query sees two keys of one position (the virtual row would be ambiguous).
    """
    S, T = vis.shape
    Tv = int(k_pos[vis.any(0)].max()) + 1 if bool(vis.any()) else 1
    col = torch.where(vis, k_pos[None, :].expand(S, T), Tv)  # invisible keys go to a spare column
    count = torch.zeros((S, Tv + 1), dtype=torch.int64, device=vis.device)
    count.scatter_add_(1, col, torch.ones_like(col))
    if bool((count[:, :Tv] > 1).any()):
        i, p = (count[:, :Tv] > 1).nonzero()[0].tolist()
        raise ValueError(f"query {i} sees several keys at position {p}: the keys one query sees "
                         f"must have distinct positions (check k_pos and the mask)")
    slots = torch.full((S, Tv + 1), -1, dtype=torch.int64, device=vis.device)
    slots.scatter_(1, col, torch.arange(T, device=vis.device).expand(S, T).contiguous())
    slots[:, Tv] = -1
    return slots[:, :Tv]


def _gather(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``x [H, T, D]``, ``slots [n, Tv]`` -> ``[n, H, Tv, D]`` (slot ``-1`` reads slot 0)."""
    return x[:, slots.clamp(min=0)].permute(1, 0, 2, 3)


def _query_chunk(Hkv: int, Tv: int, D: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // max(1, Hkv * Tv * next_pow2(D) * 4))


def packed_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                             k_pos: torch.Tensor, mask: Optional[torch.Tensor] = None,
                             causal: bool = True, window: Optional[int] = None,
                             scale: Optional[float] = None, *, chunk_bytes: int = CHUNK_BYTES
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, S, D] in q.dtype, lse [B, Hq, S] fp32)`` with keys at positions ``k_pos``."""
    g = check_attention_inputs(q, k, v, q_pos, mask, causal, window)
    check_key_positions(k_pos, k)
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    scale, qg, out, lse = grouped_buffers(q, k, g, scale)
    for b in range(B):
        vis = visible(q_pos[b], k_pos[b], None if mask is None else mask[b], causal, window)
        slots = virtual_slots(vis, k_pos[b])
        Tv = slots.shape[1]
        n = _query_chunk(Hkv, Tv, D, chunk_bytes)
        for s0 in range(0, S, n):
            s1 = min(S, s0 + n)
            sl = slots[s0:s1]
            q_c = qg[b, :, :, s0:s1].permute(2, 0, 1, 3)[:, :, :, None].float()  # [n, Hkv, g, 1, D]
            o, l, m = _forward_rows(q_c, _gather(k[b], sl), _gather(v[b], sl), q_pos[b, s0:s1, None],
                                    (sl >= 0)[:, None], causal, window, scale, True, chunk_bytes)
            seen = l > 0
            l_safe = torch.where(seen, l, 1.0)
            res = torch.where(seen[..., None], o / l_safe[..., None], 0.0)
            out[b, :, :, s0:s1] = (res[:, :, :, 0] + 0.0).to(q.dtype).permute(1, 2, 0, 3)
            lse[b, :, :, s0:s1] = torch.where(seen, m + torch.log(l_safe), _NEG_INF)[:, :, :, 0].permute(1, 2, 0)
    return out.reshape(B, Hq, S, D), lse.reshape(B, Hq, S)


def query_slots(q_pos: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each query's slot on the virtual query axis of one row and that axis's length.

    Slot ``q_pos[i] + r * Pq`` where ``r`` counts the earlier queries of the row at the same
    position and ``Pq = next_pow2(max q_pos + 1)``; the length is ``Pq`` times a power of two.
    """
    S = q_pos.shape[0]
    if S == 0:
        return q_pos.clone(), 1
    Pq = next_pow2(int(q_pos.max()) + 1)
    same = (q_pos[:, None] == q_pos[None, :]) & torch.ones(S, S, dtype=torch.bool, device=q_pos.device).tril(-1)
    rank = same.sum(1)
    return q_pos + rank * Pq, Pq * next_pow2(int(rank.max()) + 1)


def packed_attention_backward(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor,
                              k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              q_pos: torch.Tensor, k_pos: torch.Tensor,
                              mask: Optional[torch.Tensor] = None, causal: bool = True,
                              window: Optional[int] = None, scale: Optional[float] = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`packed_attention_forward` (``q``, ``dO`` finite)."""
    g = check_attention_inputs(q, k, v, q_pos, mask, causal, window)
    check_key_positions(k_pos, k)
    B, Hq, S, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dq = torch.empty((B, Hkv, g, S, D), dtype=q.dtype, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for b in range(B):
        vis = visible(q_pos[b], k_pos[b], None if mask is None else mask[b], causal, window)
        slots = virtual_slots(vis, k_pos[b])
        Tv = slots.shape[1]
        nb = -(-Tv // KV_BLOCK)
        pad = nb * KV_BLOCK - Tv
        vis_v = torch.nn.functional.pad(slots >= 0, (0, pad), value=False)  # [S, nb*KB]
        slots_p = torch.nn.functional.pad(slots, (0, pad), value=-1)
        k_v, v_v = _gather(k[b].float(), slots_p), _gather(v[b].float(), slots_p)  # [S, Hkv, L, D]
        q_b = q[b].reshape(Hkv, g, S, D).permute(2, 0, 1, 3).float()  # [S, Hkv, g, D]
        do_b = grad_out[b].reshape(Hkv, g, S, D).permute(2, 0, 1, 3).float()
        out_b = out[b].reshape(Hkv, g, S, D).permute(2, 0, 1, 3).float()
        lse_b = lse[b].reshape(Hkv, g, S).permute(2, 0, 1)
        delta = halve(do_b * out_b, -1)
        if grad_lse is not None:
            delta = delta - grad_lse[b].reshape(Hkv, g, S).permute(2, 0, 1)
        vis4 = vis_v[:, None, None, :]  # [S, 1, 1, L]
        s = halve(q_b[..., :, None] * k_v.transpose(-1, -2)[:, :, None], -2) * scale  # [S, Hkv, g, L]
        p = torch.where(vis4, torch.exp(s - lse_b[..., None]), 0.0)
        dp = halve(do_b[..., :, None] * v_v.transpose(-1, -2)[:, :, None], -2)
        ds = torch.where(vis4, p * (dp - delta[..., None]), 0.0)
        dsk = ds[..., None] * k_v[:, :, None]
        if not all_finite(k_v):
            dsk = torch.where(vis4[..., None], dsk, 0.0)
        blocks = halve(dsk.unflatten(-2, (nb, KV_BLOCK)), -2)  # [S, Hkv, g, nb, D]
        dq_b = torch.zeros_like(q_b)
        for i in range(nb):
            dq_b = dq_b + blocks[..., i, :]
        dq[b] = (dq_b * scale + 0.0).to(q.dtype).permute(1, 2, 0, 3)
        # dK, dV: contributions placed at (virtual query slot, key slot), halved over queries then g.
        qs, length = query_slots(q_pos[b])
        i_idx, p_idx = (slots_p >= 0).nonzero(as_tuple=True)
        j_idx = slots_p[i_idx, p_idx]
        for grad, contrib in ((dk, ds[..., None] * q_b[..., None, :]),
                              (dv, p[..., None] * do_b[..., None, :])):
            acc = q_b.new_zeros((length, T, Hkv, g, D))
            acc[qs[i_idx], j_idx] = contrib[i_idx, :, :, p_idx]
            total = halve(halve(acc, 0).permute(1, 0, 2, 3), 2)  # [Hkv, T, D]
            if grad is dk:
                total = total * scale
            grad[b] = (total + 0.0).to(grad.dtype)
    return dq.reshape(B, Hq, S, D), dk, dv
