"""Packed attention on CUDA for any visibility: each query alone, as one batch row, on the Triton kernels.

For visibility that is not per-document (a general 2D mask, e.g. a multi-turn conversation
whose later turns do not see an earlier turn's dropped reasoning), every query runs as one
batch row of the plain Triton kernels (:mod:`tpinv.kernels.triton_attention`,
:mod:`tpinv.kernels.triton_attention_bwd`) against its *virtual row*: the keys it sees at
slots equal to their positions (:func:`~tpinv.kernels.reference_attention_packed.virtual_slots`),
a key-validity mask hiding the rest.  A batch row's bits never depend on the other rows, so:

* ``out``, ``lse`` and ``dq`` of a query are the Triton bits of that query in its own
  context alone, wherever it is packed, at any batch size and head count;
* ``dk``, ``dv``: the backward of the batch row gives each (query, virtual slot) its fp32
  contribution (the query's ``g`` heads summed inside the kernel, times ``scale`` for dK).
  Key ``j``'s gradient is the sum of the contributions of the queries that see it, by
  contiguous halving over the *virtual query axis* of
  :func:`~tpinv.kernels.reference_attention_packed.query_slots` (query ``i`` at
  ``q_pos[i] + r * Pq``; zeros where no query sees ``j``), the axis the CPU backward halves
  over: an order set by the queries' positions, not by their slots, the batch or TP.  (A
  document packed before a conversation moves the conversation's queries at its positions up by
  whole layers: the halving over a contiguous run of layers, recursively split by the lowest
  bit, is the same at any shift up to the order of the two operands of an add, which fp32
  addition ignores; zero padding to a longer axis adds exact zeros.)  It is one fp32 sum,
  rounded once to k's dtype; zeros are returned as ``+0``.

The axis (length ``L = 2^n``) is processed in chunks of ``2^c`` queries within ``chunk_bytes``:
chunk ``r`` holds the slots ``r, r + C, r + 2C, ...`` (``C = L / 2^c``), whose contiguous
halving is the first ``c`` levels of the halving over ``L``; the ``C`` chunk sums are then
combined by the remaining levels, which equal an adjacent-pair tree over the chunks in
bit-reversed order (:class:`~tpinv.core.contract.TreeAccumulator`: ``log2 C + 1`` partial sums).  The result is the
halving over the whole axis for every chunk size (a chunk no query sits on adds exact zeros;
zeros come out ``+0``).
"""
from __future__ import annotations

from typing import Optional

import torch

from tpinv.core.contract import TreeAccumulator
from tpinv.kernels.reference_attention import halve
from tpinv.kernels.reference_attention_packed import query_slots, virtual_slots, visible
from tpinv.kernels.triton_attention import attention_forward_cuda
from tpinv.kernels.triton_attention_bwd import attention_backward_cuda

__all__ = ["rows_forward_cuda", "rows_backward_cuda", "VirtualRows", "ROWS_BYTES", "GRID_LIMIT"]

#: Bytes of the per-chunk buffers of the by-rows forward and backward (memory and speed only, never bits).
ROWS_BYTES = 1 << 30
#: The most batch rows times query heads of one launch (the kernels' grid dimension limit).
GRID_LIMIT = 65535


class VirtualRows:
    """Queries ``idx`` of batch row ``b``, each as one batch row of ``tpinv::attention`` against its
    virtual row (``slots [S, Tv]`` of row ``b``): the inputs and outputs of one by-rows launch."""

    def __init__(self, b: int, idx: torch.Tensor, slots: torch.Tensor, q_pos: torch.Tensor):
        sl = slots[idx]
        self.b, self.idx, self.slots = b, idx, sl
        self.gather = sl.clamp(min=0)
        self.q_pos = q_pos[b, idx, None].contiguous()    # [n, 1]
        self.mask = (sl >= 0)[:, None].contiguous()       # [n, 1, Tv]

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, Hkv, T, D]`` -> ``[n, Hkv, Tv, D]``: each query's keys at their positions."""
        return x[self.b][:, self.gather].permute(1, 0, 2, 3).contiguous()

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, H, S(, D)]`` -> ``[n, H, 1(, D)]``."""
        return x[self.b][:, self.idx].transpose(0, 1).unsqueeze(2).contiguous()

    def put(self, into: torch.Tensor, x: torch.Tensor) -> None:
        """Write ``x [n, H, 1(, D)]`` back into ``into [B, H, S(, D)]`` at the queries' slots."""
        into[self.b][:, self.idx] = x.squeeze(2).transpose(0, 1)


def _row_slots(b, q_pos, k_pos, mask, causal, window) -> torch.Tensor:
    return virtual_slots(visible(q_pos[b], k_pos[b], None if mask is None else mask[b], causal, window),
                         k_pos[b])


def _rows_per_launch(per_row_bytes: int, heads: int, chunk_bytes: int) -> int:
    """The power of two of batch rows a launch takes within ``chunk_bytes`` and the grid limit."""
    n = max(1, min(chunk_bytes // max(1, per_row_bytes), GRID_LIMIT // max(1, heads)))
    return 1 << (n.bit_length() - 1)


def rows_forward_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, mask: Optional[torch.Tensor], causal: bool,
                      window: Optional[int], scale: float, *, chunk_bytes: int = ROWS_BYTES
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, S, D], lse [B, Hq, S])``: each query alone against its virtual row (inputs checked)."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((B, Hq, S), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(B):
        slots = _row_slots(b, q_pos, k_pos, mask, causal, window)
        n = _rows_per_launch(2 * Hkv * slots.shape[1] * D * k.element_size(), Hq, chunk_bytes)
        for idx in torch.arange(S, device=q.device).split(n):
            rows = VirtualRows(b, idx, slots, q_pos)
            o, l = attention_forward_cuda(rows.queries(q), rows.keys(k), rows.keys(v), rows.q_pos,
                                          rows.mask, causal, window, scale)
            rows.put(out, o)
            rows.put(lse, l)
    return out, lse


def _bit_reversed(m: int) -> list[int]:
    """``0 .. 2^m - 1`` in bit-reversed order (contiguous halving over them = adjacent pairs in this order)."""
    return [int(format(i, f"0{m}b")[::-1], 2) if m else 0 for i in range(1 << m)]


def rows_backward_cuda(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       q_pos: torch.Tensor, k_pos: torch.Tensor, mask: Optional[torch.Tensor], causal: bool,
                       window: Optional[int], scale: float, *, chunk_bytes: int = ROWS_BYTES
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`rows_forward_cuda` (inputs checked)."""
    B, Hq, S, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if S == 0 or T == 0:
        return dq, dk, dv
    if bool((q_pos < 0).any()):
        raise ValueError("the by-rows backward of packed attention needs q_pos >= 0 (a query's slot on the "
                         f"virtual query axis is its position), got min {int(q_pos.min())}")
    for b in range(B):
        slots = _row_slots(b, q_pos, k_pos, mask, causal, window)
        Tv = slots.shape[1]
        qs, length = query_slots(q_pos[b])
        # per slot of a chunk: the kernel's fp32 dK, dV [Hkv, Tv, D] and the chunk's [T, Hkv, D] sums
        width = min(length, _rows_per_launch(2 * Hkv * (Tv + T) * D * 4, Hq, chunk_bytes))
        C = length // width
        chunk = qs % C                                    # query i is slot qs // C of chunk qs % C
        present, counts = torch.unique(chunk, return_counts=True)
        members = dict(zip(present.tolist(), torch.argsort(chunk, stable=True).split(counts.tolist())))
        dk_sum, dv_sum, zero = TreeAccumulator(), TreeAccumulator(), None
        for r in _bit_reversed(C.bit_length() - 1):
            idx = members.get(r)
            if idx is None:  # no query on this chunk: its sums are zeros
                zero = dk.new_zeros((T, Hkv, D), dtype=torch.float32) if zero is None else zero
                dk_sum.push(zero)
                dv_sum.push(zero)
                continue
            rows = VirtualRows(b, idx, slots, q_pos)
            dlse = None if grad_lse is None else rows.queries(grad_lse)
            dq_r, dk_r, dv_r = attention_backward_cuda(
                rows.queries(grad_out), dlse, rows.queries(q), rows.keys(k), rows.keys(v),
                rows.queries(out), rows.queries(lse), rows.q_pos, rows.mask, causal, window, scale,
                grad_kv_dtype=torch.float32)
            rows.put(dq, dq_r)
            i, p = (rows.slots >= 0).nonzero(as_tuple=True)
            at = (qs[idx][i] // C, rows.slots[i, p])       # (slot on the chunk, key)
            for acc, contrib in ((dk_sum, dk_r), (dv_sum, dv_r)):   # [n, Hkv, Tv, D] fp32
                dense = contrib.new_zeros((width, T, Hkv, D))
                dense[at] = contrib[i, :, p]
                acc.push(halve(dense, 0))
        dk[b] = (dk_sum.result() + 0.0).to(k.dtype).transpose(0, 1)
        dv[b] = (dv_sum.result() + 0.0).to(v.dtype).transpose(0, 1)
    return dq, dk, dv
