"""Packed attention on CUDA for per-document rows: each document runs as itself, alone.

The documents of the packed rows (:func:`~tpinv.kernels.packed_documents.find_documents`)
are scattered into a padded batch, one document per batch row: its keys at slots equal to
their positions ``0 .. L-1`` and each of its queries at row ``q_pos``, zeros after.  The
plain Triton kernels (:mod:`tpinv.kernels.triton_attention`,
:mod:`tpinv.kernels.triton_attention_bwd`) then compute, for every document, the bits of the
same document run alone through ``tpinv::attention`` (``q_pos = k_pos = arange``): their
orders depend only on a row's own slots and rows from 0, never on the batch, and the padding
adds nothing to a document:

* forward and dQ: a query's key blocks start at slot 0 = the document's position 0; the
  padded keys sit after every key the query may see (causal), or are masked out (``causal=False``
  or a query past the document's last key, where the batch gets a key-validity mask:
  the masked path computes the same bits as the unmasked one);
* dK, dV: a key block sums over row tiles of the query rows from row 0 in increasing order
  (position order); padded rows carry ``dO = 0``, ``out = 0``, ``dlse = 0`` and a finite
  ``lse = 0``, so their terms are exact zeros, and the tiles after the document add exact zeros.

Gathering back puts every value at the slot its token was packed at, so a document packed
at any offset of any row gets the bits of itself alone.  A document of ``SOLO_LENGTH`` tokens
or more runs in a launch of its own, on views of the packed tensors when its queries are its
tokens in order (no padding, no copy in); shorter ones are grouped by the power of two above
their length (padding at most doubles a document's work), at most ``65535 // Hq`` documents a
launch (the kernels' grid limit).  Queries that see no
key get ``out = 0``, ``lse = -inf`` and ``dq = 0``; keys no query sees get ``dk = dv = 0``.
Visibility that is not per-document has no kernel here (the caller decides).
"""
from __future__ import annotations

from typing import Optional

import torch

from tpinv.kernels.packed_documents import PackedDocuments
from tpinv.kernels.reference_attention import KV_BLOCK
from tpinv.kernels.triton_attention import attention_forward_cuda
from tpinv.kernels.triton_attention_bwd import attention_backward_cuda

__all__ = ["documents_forward_cuda", "documents_backward_cuda", "document_groups", "launches"]

#: The most documents (times query heads) one launch takes: the kernels' grid dimension limit.
GRID_LIMIT = 65535
#: Documents this long (keys or queries) run in a launch of their own (speed only).
SOLO_LENGTH = 1024


def document_groups(docs: PackedDocuments, heads: int) -> list[torch.Tensor]:
    """Document ids per launch: each document of ``SOLO_LENGTH`` or more alone; the others by the
    power of two above ``max(length, q_len, KV_BLOCK)``, at most ``GRID_LIMIT // heads`` a launch."""
    extent = torch.maximum(torch.maximum(docs.length, docs.q_len), torch.tensor(KV_BLOCK))
    solo = extent >= SOLO_LENGTH
    groups = list(solo.nonzero().flatten().split(1))
    bucket = torch.ceil(torch.log2(extent.double())).long()
    per_launch = max(1, GRID_LIMIT // max(1, heads))
    for b in torch.unique(bucket[~solo]).tolist():
        groups += list(((bucket == b) & ~solo).nonzero().flatten().split(per_launch))
    return [ids for ids in groups if ids.numel()]


class _Launch:
    """The padded batch of one group of documents: where its tokens come from and go to.

    A lone document whose queries are positions ``0 .. q_len-1`` at consecutive slots is a
    view of the packed tensors (no copy); other groups gather their tokens.
    """

    def __init__(self, docs: PackedDocuments, ids: torch.Tensor, causal: bool):
        device = docs.key_row.device
        self.n = int(ids.numel())
        length, q_len = docs.length[ids], docs.q_len[ids]
        self.T, self.S = int(length.max()), int(q_len.max())
        self.view = None
        if self.n == 1 and int(docs.query_start[ids]) >= 0:
            self.view = (int(docs.row[ids]), int(docs.key_start[ids]), int(docs.query_start[ids]))
        else:
            local = torch.full((docs.n,), -1, dtype=torch.int64)
            local[ids] = torch.arange(self.n)
            local = local.to(device)
            key_doc, query_doc = local[docs.key_doc], local[docs.query_doc]
            keys, queries = (key_doc >= 0).nonzero().flatten(), (query_doc >= 0).nonzero().flatten()
            self.key_src = (docs.key_row[keys], docs.key_slot[keys])
            self.key_dst = (key_doc[keys], docs.key_pos[keys])
            self.query_src = (docs.query_row[queries], docs.query_slot[queries])
            self.query_dst = (query_doc[queries], docs.query_pos[queries])
        self.q_pos = torch.arange(self.S, device=device).expand(self.n, self.S).contiguous()
        self.mask = None
        padded = length < self.T  # padded keys a query could see: hide them
        if bool((padded & ((q_len > length) | (not causal))).any()):
            key_ok = torch.arange(self.T)[None, :] < length[:, None]
            self.mask = key_ok.to(device)[:, None, :].expand(self.n, self.S, self.T)

    def pad(self, x: torch.Tensor, keys: bool, fill: float = 0.0) -> torch.Tensor:
        """``x [B, H, N(, D)]`` -> ``[n, H, T or S(, D)]``: the group's tokens at their positions."""
        if self.view is not None:
            row, k0, q0 = self.view
            start, size = (k0, self.T) if keys else (q0, self.S)
            return x[row:row + 1, :, start:start + size]
        src, dst = (self.key_src, self.key_dst) if keys else (self.query_src, self.query_dst)
        x_t = x.transpose(1, 2)  # [B, N, H(, D)]
        out = x_t.new_full((self.n, self.T if keys else self.S) + tuple(x_t.shape[2:]), fill)
        out[dst] = x_t[src]
        return out.transpose(1, 2)

    def unpad(self, into: torch.Tensor, x: torch.Tensor, keys: bool) -> None:
        """Write the group's tokens of ``x [n, H, T or S(, D)]`` back into ``into [B, H, N(, D)]``."""
        if self.view is not None:
            self.pad(into, keys).copy_(x)
            return
        src, dst = (self.key_src, self.key_dst) if keys else (self.query_src, self.query_dst)
        into.transpose(1, 2)[src] = x.transpose(1, 2)[dst]


def launches(docs: PackedDocuments, heads: int, causal: bool) -> list[_Launch]:
    """The launches of ``docs``, built once and kept with them (the documents of a step are
    shared by every layer, forward and backward: their index tensors are built, and the host
    waits for the device, once)."""
    key = ("launches", heads, bool(causal), SOLO_LENGTH, GRID_LIMIT)
    if key not in docs.plans:
        docs.plans[key] = [_Launch(docs, ids, causal) for ids in document_groups(docs, heads)]
    return docs.plans[key]


def documents_forward_cuda(docs: PackedDocuments, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           causal: bool, window: Optional[int], scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, S, D], lse [B, Hq, S])`` of per-document packed rows (inputs checked)."""
    B, Hq, S, _ = q.shape
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((B, Hq, S), float("-inf"), dtype=torch.float32, device=q.device)
    for run in launches(docs, Hq, causal):
        o, l = attention_forward_cuda(run.pad(q, False), run.pad(k, True), run.pad(v, True), run.q_pos,
                                      run.mask, causal, window, scale)
        run.unpad(out, o, False)
        run.unpad(lse, l, False)
    return out, lse


def documents_backward_cuda(docs: PackedDocuments, grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor],
                            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            lse: torch.Tensor, causal: bool, window: Optional[int], scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`documents_forward_cuda` (inputs checked)."""
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    for run in launches(docs, q.shape[1], causal):
        dlse = None if grad_lse is None else run.pad(grad_lse, False)
        g = attention_backward_cuda(run.pad(grad_out, False), dlse, run.pad(q, False), run.pad(k, True),
                                    run.pad(v, True), run.pad(out, False), run.pad(lse, False), run.q_pos,
                                    run.mask, causal, window, scale)
        for into, x, keys in ((dq, g[0], False), (dk, g[1], True), (dv, g[2], True)):
            run.unpad(into, x, keys)
    return dq, dk, dv
