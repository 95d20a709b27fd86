"""Packed attention by documents on the Triton kernels, under Triton's interpreter (CPU).

:mod:`tpinv.kernels.triton_attention_packed` runs each document of per-document packed rows
alone in a padded batch of the Triton kernels.  Here, byte for byte: a document packed at
offsets 1, 37, 64 and 200 of four rows (three documents per row, one call) gets out, lse,
dq, dk and dv of the same document through the Triton kernels alone; the same with a sliding
window and without causality (the padded batch then hides its padding with a key mask).
The document's rows and key slots sit at the same indices as alone, so even the
interpreter's numpy dots see the same operands.  Control, by construction: the slot grid
(positions = slots, no ``k_pos``) runs the document at offset 37 with its key-block and
row-tile boundaries moved, and its lse and dk differ.  fp32 and fp16 (bf16 is not reliable
in the interpreter); the GPU twin is ``tests/gpu/test_attention_packed_cuda.py``.
"""
from __future__ import annotations

import importlib.util
import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from test_packed_documents import OFFSETS  # noqa: E402
from triton_interp import interpreted_test, main, seeded_checks  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits, packed_document_rows  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
NAMES = ("out", "lse", "dq", "dk", "dv")
SCALE = 0.25


def _inputs(B, Hkv, g, T, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, Hkv * g, T, D, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv, T, D, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, do, torch.randn(B, Hkv * g, T, generator=gen)


def _documents(pos, mask, tensors, causal, window):
    from tpinv.kernels.packed_documents import find_documents
    from tpinv.kernels.triton_attention_packed import documents_backward_cuda, documents_forward_cuda
    q, k, v, do, dlse = tensors
    docs = find_documents(pos, pos, mask, causal, window)
    assert docs is not None, "the per-document path must run"
    out, lse = documents_forward_cuda(docs, q, k, v, causal, window, SCALE)
    return (out, lse) + documents_backward_cuda(docs, do, dlse, q, k, v, out, lse, causal, window, SCALE)


def _plain(tensors, q_pos, mask, causal, window):
    from tpinv.kernels.triton_attention import attention_forward_cuda
    from tpinv.kernels.triton_attention_bwd import attention_backward_cuda
    q, k, v, do, dlse = tensors
    out, lse = attention_forward_cuda(q, k, v, q_pos, mask, causal, window, SCALE)
    return (out, lse) + attention_backward_cuda(do, dlse, q, k, v, out, lse, q_pos, mask, causal, window, SCALE)


def _alone(tensors, row, span, causal, window):
    part = tuple(t[row:row + 1, :, span].contiguous() for t in tensors)
    return _plain(part, torch.arange(part[0].shape[2])[None], None, causal, window)


def _assert_documents_alone(packed, tensors, row, spans, causal, window, what):
    for span in spans:
        alone = _alone(tensors, row, span, causal, window)
        for name, p, a in zip(NAMES, packed, alone):
            assert_same_bits(p[row:row + 1, :, span], a, f"{what}: {name} of row {row}, slots {span}")


def _documents_at_offsets(dtype):
    n, total = 83, 300  # the document spans a key block and a row tile boundary
    pos, mask = packed_document_rows([(o, n, total - o - n) for o in OFFSETS])
    tensors = _inputs(len(OFFSETS), 1, 2, total, 16, dtype, seed=0)
    packed = _documents(pos, mask, tensors, True, None)
    for row, o in enumerate(OFFSETS):
        _assert_documents_alone(packed, tensors, row, (slice(o, o + n), slice(o + n, total)), True, None,
                                str(dtype))


def check_documents_at_offsets_equal_alone_fp32():
    _documents_at_offsets(torch.float32)


def check_documents_at_offsets_equal_alone_fp16():
    _documents_at_offsets(torch.float16)


def check_window_and_full_visibility():
    o, n, total = 37, 83, 140
    pos, mask = packed_document_rows([(o, n, total - o - n)])
    tensors = _inputs(1, 1, 2, total, 16, torch.float32, seed=1)
    for causal, window in ((True, 19), (False, None)):
        packed = _documents(pos, mask, tensors, causal, window)
        _assert_documents_alone(packed, tensors, 0, (slice(0, o), slice(o, o + n)), causal, window,
                                f"causal={causal} window={window}")


def check_slot_grid_differs():
    """Control: the slot grid moves the block (64 keys) and tile (32 fp32 rows) boundaries."""
    o, n, total = 37, 83, 140
    pos, mask = packed_document_rows([(o, n, total - o - n)])
    tensors = _inputs(1, 1, 2, total, 16, torch.float32, seed=2)
    span = slice(o, o + n)
    slot = _plain(tensors, torch.arange(total)[None], mask, True, None)
    alone = _alone(tensors, 0, span, True, None)
    assert_bits_differ(slot[1][:, :, span], alone[1], "slot-grid lse vs alone")
    assert_bits_differ(slot[3][:, :, span], alone[3], "slot-grid dk vs alone")
    packed = _documents(pos, mask, tensors, True, None)  # and the documents path on the same row agrees
    assert_same_bits(packed[3][:, :, span], alone[3], "document dk vs alone")


CHECKS = seeded_checks(dict(globals()))
test_interpreter = interpreted_test(__file__, CHECKS, process_per_check=True)

if __name__ == "__main__":
    main(CHECKS)
