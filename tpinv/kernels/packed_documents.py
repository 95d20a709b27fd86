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
it decides from the values of ``q_pos``, ``k_pos`` and ``mask`` only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tpinv.kernels.reference_attention_packed import visible

__all__ = ["PackedDocuments", "find_documents"]


@dataclass(frozen=True)
class PackedDocuments:
    """Documents ``0 .. n-1`` of a packed batch, and where their tokens sit.

    ``length[d]`` keys (positions ``0 .. length-1``) and queries up to position
    ``q_len[d] - 1`` (host tensors).  Key ``m`` of some document is
    ``k[key_row[m], :, key_slot[m]]`` at position ``key_pos[m]`` of document ``key_doc[m]``;
    likewise the queries (device tensors).
    """

    length: torch.Tensor
    q_len: torch.Tensor
    key_row: torch.Tensor
    key_slot: torch.Tensor
    key_doc: torch.Tensor
    key_pos: torch.Tensor
    query_row: torch.Tensor
    query_slot: torch.Tensor
    query_doc: torch.Tensor
    query_pos: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.length.shape[0])


def _runs(k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(run id of each key slot [T], first position of each run [n_runs])`` of one row."""
    starts = torch.ones_like(k_pos, dtype=torch.bool)
    starts[1:] = k_pos[1:] != k_pos[:-1] + 1
    return torch.cumsum(starts, 0) - 1, k_pos[starts]


def _row_documents(q_pos, k_pos, mask, causal, window):
    """``(run of each query [S] (-1: none), run of each key [T], used runs)`` or ``None``."""
    run, first_pos = _runs(k_pos)
    rule = visible(q_pos, k_pos, None, causal, window)
    vis = rule if mask is None else rule & mask
    seen = vis.any(1)
    first = vis.to(torch.uint8).argmax(1)  # the first key slot each query sees
    run_q = torch.where(seen, run[first], -1)
    if not torch.equal(vis, (run[None, :] == run_q[:, None]) & rule):
        return None  # some query sees keys of several runs, or only part of one
    used = torch.unique(run_q[seen])
    if bool((first_pos[used] != 0).any()):
        return None  # a document whose keys do not start at position 0
    span = int(q_pos.max()) + 1 if q_pos.numel() else 1
    key = run_q[seen] * span + q_pos[seen]
    if torch.unique(key).numel() != key.numel():
        return None  # two queries of one document at one position
    return run_q, run, used


def find_documents(q_pos: torch.Tensor, k_pos: torch.Tensor, mask: Optional[torch.Tensor],
                   causal: bool, window: Optional[int]) -> Optional[PackedDocuments]:
    """The documents of ``[B, S]`` queries and ``[B, T]`` keys, or ``None`` when some row is not
    per-document (see the module docstring)."""
    B, device = q_pos.shape[0], q_pos.device
    length, q_len = [], []
    keys, queries = [[] for _ in range(4)], [[] for _ in range(4)]
    n = 0
    for b in range(B):
        found = _row_documents(q_pos[b], k_pos[b], None if mask is None else mask[b], causal, window)
        if found is None:
            return None
        run_q, run, used = found
        doc_of_run = torch.full((int(run[-1]) + 1 if run.numel() else 1,), -1, dtype=torch.int64,
                                device=device)
        doc_of_run[used] = torch.arange(n, n + used.numel(), device=device)
        key_slot = (doc_of_run[run] >= 0).nonzero().flatten()
        query_slot = (run_q >= 0).nonzero().flatten()
        key_doc, query_doc = doc_of_run[run[key_slot]], doc_of_run[run_q[query_slot]]
        for into, row in ((keys, (key_slot, key_doc, k_pos[b, key_slot])),
                          (queries, (query_slot, query_doc, q_pos[b, query_slot]))):
            into[0].append(torch.full_like(row[0], b))
            for part, t in zip(into[1:], row):
                part.append(t)
        length.append(torch.bincount(key_doc - n, minlength=used.numel()))
        top = torch.zeros(used.numel(), dtype=torch.int64, device=device)
        q_len.append(top.scatter_reduce(0, query_doc - n, q_pos[b, query_slot] + 1, "amax"))
        n += used.numel()
    cat = (lambda parts: torch.cat(parts)) if B else (
        lambda parts: torch.zeros(0, dtype=torch.int64, device=device))
    return PackedDocuments(cat(length).cpu(), cat(q_len).cpu(), *(cat(p) for p in keys),
                           *(cat(p) for p in queries))
