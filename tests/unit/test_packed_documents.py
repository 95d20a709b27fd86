"""The documents of packed rows (:mod:`tpinv.kernels.packed_documents`) and the padded batch
that runs each one alone (:mod:`tpinv.kernels.triton_attention_packed`), on CPU.

The padded batch is checked here with the CPU attention kernels in place of the Triton ones
(both keep a row's bits whatever else is in the batch and whatever padding follows it), so
its scatter and gather are tested in seconds; the Triton kernels run it in
``test_triton_attention_packed_interp.py`` (interpreter) and ``tests/gpu/test_attention_packed_cuda.py``.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tpinv.kernels.packed_documents import documents_of, find_documents
from tpinv.kernels.reference_attention import KV_BLOCK, attention_forward
from tpinv.kernels.reference_attention_bwd import attention_backward
from tpinv.testing import assert_bits_differ, assert_same_bits, attention_inputs, packed_document_rows

OFFSETS = (1, 37, 64, 200)


def test_documents_of_packed_rows():
    pos, mask = packed_document_rows([(5, 70, 3), (30, 48, 0)])
    docs = find_documents(pos, pos, mask, True, None)
    assert docs is not None
    assert docs.length.tolist() == [5, 70, 3, 30, 48] and docs.q_len.tolist() == docs.length.tolist()
    for row, slot, d, p in ((docs.key_row, docs.key_slot, docs.key_doc, docs.key_pos),
                            (docs.query_row, docs.query_slot, docs.query_doc, docs.query_pos)):
        assert_same_bits(p, pos[row, slot], "a token's position in its document")
        starts = torch.tensor([0, 5, 75, 0, 30])
        assert_same_bits(slot - p, starts[d], "a document's first slot")
    assert docs.key_start.tolist() == docs.query_start.tolist() == [0, 5, 75, 0, 30]
    assert docs.row.tolist() == [0, 0, 0, 1, 1]
    mask[0, 7] = False  # query 7 (position 2 of the second document) sees nothing
    assert find_documents(pos, pos, mask, True, None).query_start.tolist() == [0, -1, 75, 0, 30]


def test_unpacked_row_is_one_document():
    pos = torch.arange(40)[None]
    docs = find_documents(pos, pos, None, True, 7)
    assert docs is not None and docs.length.tolist() == [40]


def test_queries_seeing_nothing_belong_to_no_document():
    pos, mask = packed_document_rows([(6, 10)])
    mask[0, 2] = False  # query 2 sees no key
    docs = find_documents(pos, pos, mask, True, None)
    assert docs is not None and 2 not in docs.query_slot.tolist() and docs.query_slot.numel() == 15


def test_general_visibility_has_no_documents():
    p, r, a = 6, 3, 2  # prefix, then reasoning, then an answer restated at the reasoning's positions
    pos = torch.cat([torch.arange(p + r), torch.arange(p, p + a)])[None]
    ctx = torch.cat([torch.zeros(p), torch.ones(r), 2 * torch.ones(a)])
    two_contexts = ((ctx[:, None] == ctx[None, :]) | (ctx[None, :] == 0))[None]
    assert find_documents(pos, pos, two_contexts, True, None) is None
    pos, mask = packed_document_rows([(8, 8)])
    holed = mask.clone()
    holed[0, 12, 9] = False  # a query sees part of its document
    assert find_documents(pos, pos, holed, True, None) is None
    late = (pos + 3) * (pos >= 0)  # documents whose positions start at 3
    assert find_documents(late, late, mask, True, None) is None
    first_doc = torch.zeros_like(mask)
    first_doc[:, :, :8] = True  # every query sees the first document: two queries per position
    assert find_documents(pos, pos, first_doc, True, None) is None
    assert find_documents(pos, pos, mask, True, None) is not None  # the control


def test_documents_of_the_same_tensors_are_kept_until_they_change():
    pos, mask = packed_document_rows([(8, 8)])
    first = documents_of(pos, pos, mask, True, None)
    assert first is not None and documents_of(pos, pos, mask, True, None) is first
    assert documents_of(pos, pos, mask, True, 3) is not first  # another window
    assert documents_of(pos, pos, mask, True, None) is not None
    mask[0, 12, 9] = False  # in place: the version counter moves, the answer is found again
    assert documents_of(pos, pos, mask, True, None) is None
    fresh = mask.clone()
    fresh[0, 12, 9] = True  # another tensor: never the kept answer
    assert documents_of(pos, pos, fresh, True, None) is not None


# ------------------------------------------------------------ the padded batch, CPU kernels

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _reference_forward(q, k, v, q_pos, mask, causal, window, scale):
    return attention_forward(q, k, v, q_pos, mask, causal, window, scale)


def _reference_backward(do, dlse, q, k, v, out, lse, q_pos, mask, causal, window, scale):
    return attention_backward(do, dlse, q, k, v, out, lse, q_pos, mask, causal, window, scale)


@pytest.fixture
def cpu_documents(monkeypatch):
    import tpinv.kernels.triton_attention_packed as run
    monkeypatch.setattr(run, "attention_forward_cuda", _reference_forward)
    monkeypatch.setattr(run, "attention_backward_cuda", _reference_backward)
    return run


def _documents(run, pos, mask, tensors, causal, window, scale=0.3):
    q, k, v, do, dlse = tensors
    docs = find_documents(pos, pos, mask, causal, window)
    assert docs is not None, "the per-document path must run"
    out, lse = run.documents_forward_cuda(docs, q, k, v, causal, window, scale)
    return (out, lse) + run.documents_backward_cuda(docs, do, dlse, q, k, v, out, lse, causal, window, scale)


def _alone(tensors, span, causal, window, scale=0.3, row=0):
    q, k, v, do, dlse = (t[row:row + 1, :, span].contiguous() for t in tensors)
    n = q.shape[2]
    pos = torch.arange(n)[None]
    out, lse = attention_forward(q, k, v, pos, None, causal, window, scale)
    return (out, lse) + attention_backward(do, dlse, q, k, v, out, lse, pos, None, causal, window, scale)


NAMES = ("out", "lse", "dq", "dk", "dv")


@needs_triton
@pytest.mark.parametrize("causal,window,solo", [(True, None, 1024), (True, 19, 1024), (False, None, 1024),
                                               (True, None, 80), (False, None, 80)])
def test_padded_batch_gives_each_document_alone(cpu_documents, monkeypatch, causal, window, solo):
    """Documents shorter than ``solo`` share padded launches, longer ones run on views."""
    monkeypatch.setattr(cpu_documents, "SOLO_LENGTH", solo)
    n, total = 83, 300  # the document spans a block boundary
    lengths = [(o, n, total - o - n) for o in OFFSETS]
    pos, mask = packed_document_rows(lengths)
    tensors = attention_inputs(len(OFFSETS), 2, 2, total, 8, seed=1)
    packed = _documents(cpu_documents, pos, mask, tensors, causal, window)
    for row, o in enumerate(OFFSETS):
        for span in (slice(0, o), slice(o, o + n), slice(o + n, total)):
            alone = _alone(tensors, span, causal, window, row=row)
            for name, p, a in zip(NAMES, packed, alone):
                assert_same_bits(p[row:row + 1, :, span], a, f"{name} of row {row}, slots {span}")
    # Control: the slot grid runs the document at offset 37 with its block boundary moved.
    row, o = OFFSETS.index(37), 37
    assert o % KV_BLOCK
    q, k, v = (t[row:row + 1] for t in tensors[:3])
    _, slot_lse = attention_forward(q, k, v, torch.arange(total)[None], mask[row:row + 1], causal, window, 0.3)
    alone = _alone(tensors, slice(o, o + n), causal, window, row=row)
    assert_bits_differ(slot_lse[:, :, o:o + n], alone[1], "slot grid (moved block boundary) vs alone")
