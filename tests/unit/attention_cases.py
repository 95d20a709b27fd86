"""Inputs and fp64 / vanilla references shared by the attention tests."""
from __future__ import annotations

from typing import Optional

import torch
from tpinv.testing import same_bits
from tpinv.models.vanilla import split_kv_attention

#: Fresh draws a control may take before it must have seen the vanilla path differ.
CONTROL_TRIES = 10


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def qkv(B: int, Hkv: int, g: int, S: int, T: int, D: int, dtype: torch.dtype):
    return (randn(B, Hkv * g, S, D, dtype=dtype), randn(B, Hkv, T, D, dtype=dtype),
            randn(B, Hkv, T, D, dtype=dtype))


def arange_pos(B: int, S: int, start: int = 0) -> torch.Tensor:
    return (torch.arange(S, dtype=torch.int64) + start).expand(B, S).contiguous()


def visibility(q_pos: torch.Tensor, T: int, causal: bool = True, window: Optional[int] = None,
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The semantics of the op, written directly: bool ``[B, S, T]``."""
    j = torch.arange(T)[None, None, :]
    p = q_pos[:, :, None]
    vis = torch.ones(q_pos.shape[0], q_pos.shape[1], T, dtype=torch.bool)
    if causal:
        vis &= j <= p
    if window is not None:
        vis &= j > p - window
    if mask is not None:
        vis &= mask
    return vis


def sdpa(q, k, v, vis: torch.Tensor) -> torch.Tensor:
    """Vanilla attention, the negative control, with a boolean visibility ``[B, S, T]``: the
    vanilla model's CPU attention (:func:`tpinv.models.vanilla.split_kv_attention`: plain torch
    ops whose key chunks, and so the order of the softmax sums, follow the call's shape), which
    changes with prefill vs decode, padding and batch composition on every CPU kernel set."""
    return split_kv_attention(q, k, v, vis[:, None])


def sdpa_decode_differs(q, k, v, vis: torch.Tensor, steps: int, attend=sdpa) -> bool:
    """Control: does vanilla attention (``attend``) of the last ``steps`` queries, one decode
    step each against the keys so far, differ from the same rows of the full prefill?"""
    S = q.shape[2]
    full = attend(q, k, v, vis)
    last = range(S - steps, S)
    decoded = torch.cat([attend(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], vis[:, i:i + 1, :i + 1])
                         for i in last], 2)
    return not same_bits(full[:, :, last.start:], decoded)


def reference(q, k, v, vis: torch.Tensor, scale: Optional[float] = None):
    """fp64 ``(out, lse)``; rows with no visible key give ``out = 0`` and ``lse = -inf``."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~vis[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def ragged_batch(lengths: list[int], T: int, Hkv: int, g: int, D: int, dtype: torch.dtype,
                 garbage: float = float("nan")):
    """Requests of ``lengths`` at random batch rows, right-padded to ``T`` queries and keys.

    Returns ``(requests, (q, k, v, q_pos), order)``: ``requests[i] = (q, k, v)`` of request
    ``i`` alone; it sits at batch row ``order[i]``.  Padding query rows are random, padding
    key/value slots hold ``garbage``.
    """
    requests = [qkv(1, Hkv, g, L, L, D, dtype) for L in lengths]
    order = torch.randperm(len(lengths)).tolist()
    B = len(lengths)
    q = randn(B, Hkv * g, T, D, dtype=dtype)
    k = torch.full((B, Hkv, T, D), garbage, dtype=dtype)
    v = torch.full((B, Hkv, T, D), garbage, dtype=dtype)
    for (rq, rk, rv), b in zip(requests, order):
        L = rq.shape[2]
        q[b, :, :L], k[b, :, :L], v[b, :, :L] = rq[0], rk[0], rv[0]
    return requests, (q, k, v, arange_pos(B, T)), order
