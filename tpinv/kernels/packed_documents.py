"""The documents of packed rows, when every query sees exactly one document's keys.

A row's key slots split into *runs*: a run starts at slot 0 and wherever
``k_pos[j] != k_pos[j - 1] + 1``.  The row is *per-document* when every query sees exactly
the keys of one run that causality and the window allow at its position (with ``mask`` or
without), that run's positions are ``0 .. L-1``, and no two queries seeing that run share
a position.  A query that sees no key belongs to no document.  Each used run is then a
*document*: its keys at slots ``0 .. L-1`` and each of its queries at row ``q_pos`` of a row
of its own is the document alone (``k_pos = arange``, queries in position order), whatever
slot of whatever row it was packed at.  :func:`find_documents` returns ``None`` for any
other visibility (a general 2D mask: a query seeing keys of several runs, or part of a run);
it decides from the values of ``q_pos``, ``k_pos`` and ``mask`` only, reading ``[B, S, T]``
visibility in chunks of rows (none without a mask when each row is one run).

Every attention layer of a model sees the same ``positions`` and ``mask`` tensors, forward and
backward, so :func:`documents_of` keeps the answer for the last ones: the very same tensor
objects (held by weak reference, so a dead tensor never matches) at the same version counter
(an in-place change, through any view, misses).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from tpinv.kernels.reference_attention_packed import visible

__all__ = ["PackedDocuments", "find_documents", "documents_of"]

#: Elements of ``[rows, S, T]`` visibility built at once when a mask must be checked.
VISIBILITY_CHUNK = 1 << 27


@dataclass(frozen=True)
class PackedDocuments:
    """Documents ``0 .. n-1`` of a packed batch, and where their tokens sit.

    Host tensors ``[n]``: ``length`` keys (positions ``0 .. length-1``, slots
    ``key_start ..`` of batch row ``row``), queries up to position ``q_len - 1``, and
    ``query_start``: the slot of position 0 when the queries are exactly positions
    ``0 .. q_len-1`` at consecutive slots, else ``-1``.  Device tensors: key ``m`` of some
    document is ``k[key_row[m], :, key_slot[m]]`` at position ``key_pos[m]`` of document
    ``key_doc[m]``; likewise the queries.
    """

    length: torch.Tensor
    q_len: torch.Tensor
    row: torch.Tensor
    key_start: torch.Tensor
    query_start: torch.Tensor
    key_row: torch.Tensor
    key_slot: torch.Tensor
    key_doc: torch.Tensor
    key_pos: torch.Tensor
    query_row: torch.Tensor
    query_slot: torch.Tensor
    query_doc: torch.Tensor
    query_pos: torch.Tensor
    #: what the kernels derive from the documents, kept with them (filled by the kernels' module)
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def n(self) -> int:
        return int(self.length.shape[0])


def _runs_of_queries(q_pos, k_pos, mask, causal, window, run, first_pos):
    """``(run of each query [B, S] (-1: sees nothing), bad)``: ``bad`` (device bool) when some
    query sees other keys than its run's, or a run not starting at position 0."""
    B, S = q_pos.shape
    T = k_pos.shape[1]
    if mask is None and not bool((run != run[:, :1]).any()):  # one run per row: no [S, T] needed
        lo = torch.zeros_like(q_pos) if window is None else q_pos - window + 1
        hi = q_pos if causal else torch.full_like(q_pos, T - 1)
        p0 = k_pos[:, :1]
        seen = torch.maximum(lo, p0) <= torch.minimum(hi, p0 + T - 1)
        return torch.where(seen, run[:, :1], -1), (seen & (first_pos[:, :1] != 0)).any()
    run_q = torch.empty_like(q_pos)
    bad = torch.zeros((), dtype=torch.bool, device=q_pos.device)
    step = max(1, VISIBILITY_CHUNK // max(1, S * T))
    for b0 in range(0, B, step):
        rows = slice(b0, b0 + step)
        rule = visible(q_pos[rows], k_pos[rows], None, causal, window)   # causality and window
        vis = rule if mask is None else rule & mask[rows]
        seen = vis.any(2)
        first = vis.to(torch.uint8).argmax(2)  # the first key slot each query sees
        rq = torch.where(seen, run[rows].gather(1, first), -1)
        run_q[rows] = rq
        bad |= ((run[rows, None, :] == rq[:, :, None]) & rule).ne(vis).any()
        bad |= (seen & (first_pos[rows].gather(1, first) != 0)).any()
    return run_q, bad


def _amin_amax(index, values, n):
    lo = torch.full((n,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=values.device)
    hi = torch.full((n,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=values.device)
    return lo.scatter_reduce_(0, index, values, "amin"), hi.scatter_reduce_(0, index, values, "amax")


def find_documents(q_pos: torch.Tensor, k_pos: torch.Tensor, mask: Optional[torch.Tensor],
                   causal: bool, window: Optional[int]) -> Optional[PackedDocuments]:
    """The documents of ``[B, S]`` queries and ``[B, T]`` keys, or ``None`` when some row is not
    per-document (see the module docstring)."""
    B, S = q_pos.shape
    T = k_pos.shape[1]
    device = q_pos.device
    slot = torch.arange(T, device=device)
    starts = torch.ones_like(k_pos, dtype=torch.bool)
    starts[:, 1:] = k_pos[:, 1:] != k_pos[:, :-1] + 1
    start_slot = torch.where(starts, slot, 0).cummax(1).values if T else starts.long()
    run = start_slot + torch.arange(B, device=device)[:, None] * T  # a run's id: its first slot, flat
    first_pos = k_pos - slot + start_slot  # each key's run's first position
    if S and T:
        run_q, bad = _runs_of_queries(q_pos, k_pos, mask, causal, window, run, first_pos)
    else:
        run_q, bad = torch.full_like(q_pos, -1), torch.zeros((), dtype=torch.bool, device=device)
    rq, qp = run_q.flatten(), q_pos.flatten()
    order = qp.sort(stable=True).indices
    order = order[rq[order].sort(stable=True).indices]  # by run, then by position
    a, p = rq[order], qp[order]
    twice = ((a[1:] == a[:-1]) & (p[1:] == p[:-1]) & (a[1:] >= 0)).any()
    bad = bad | ((rq >= 0) & (qp < 0)).any()  # a seen query before position 0 (no causality)
    used = torch.zeros(B * T + 1, dtype=torch.int64, device=device).scatter_add_(
        0, rq.clamp(min=0), (rq >= 0).long())[:B * T] > 0
    bad, twice, n = torch.stack([bad.long(), twice.long(), used.sum()]).tolist()
    if bad or twice:
        return None
    doc_of_run = torch.cumsum(used, 0) - 1
    flat_run = run.flatten()
    keys = used[flat_run].nonzero().flatten()
    queries = (rq >= 0).nonzero().flatten()
    key_doc, query_doc = doc_of_run[flat_run[keys]], doc_of_run[rq[queries]]
    key_slot, query_slot, query_pos = keys % max(T, 1), queries % max(S, 1), qp[queries]
    length = torch.zeros(n, dtype=torch.int64, device=device).scatter_add_(0, key_doc, torch.ones_like(key_doc))
    q_len = torch.zeros(n, dtype=torch.int64, device=device).scatter_reduce_(0, query_doc, query_pos + 1, "amax")
    count = torch.zeros(n, dtype=torch.int64, device=device).scatter_add_(0, query_doc, torch.ones_like(query_doc))
    q0, q1 = _amin_amax(query_doc, query_slot - query_pos, n)
    key_start, _ = _amin_amax(key_doc, key_slot, n)
    row, _ = _amin_amax(key_doc, keys // max(T, 1), n)
    query_start = torch.where((q0 == q1) & (count == q_len), q0, -1)
    host = torch.stack([length, q_len, row, key_start, query_start]).cpu()
    return PackedDocuments(*host, keys // max(T, 1), key_slot, key_doc, k_pos.flatten()[keys],
                           queries // max(S, 1), query_slot, query_doc, query_pos)


_last: dict = {}


def _key(tensors, causal, window):
    return tuple((t._version, t.shape) if t is not None else None for t in tensors) + (bool(causal), window)


def documents_of(q_pos: torch.Tensor, k_pos: torch.Tensor, mask: Optional[torch.Tensor],
                 causal: bool, window: Optional[int]) -> Optional[PackedDocuments]:
    """:func:`find_documents`, answered again without work for the same tensors as the last call."""
    tensors = (q_pos, k_pos, mask)
    refs = _last.get("refs")
    if refs is not None and all((r is None and t is None) or (r is not None and r() is t)
                                for r, t in zip(refs, tensors)) and _last["key"] == _key(tensors, causal, window):
        return _last["docs"]
    docs = find_documents(q_pos, k_pos, mask, causal, window)
    _last.update(refs=tuple(None if t is None else weakref.ref(t) for t in tensors),
                 key=_key(tensors, causal, window), docs=docs)
    return docs
