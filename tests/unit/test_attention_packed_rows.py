"""Packed attention by rows (:mod:`tpinv.kernels.triton_attention_packed_rows`: the CUDA method for
visibility that is not per-document), run here on CPU with the reference kernels in place of the
Triton ones (both keep a batch row's bits whatever else is in the batch), so the virtual rows, the
scatter and the halving over the virtual query axis are tested in seconds; the Triton kernels run it
in ``test_triton_attention_packed_rows_interp.py`` (interpreter) and
``tests/gpu/test_attention_packed_rows_cuda.py``."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tpinv.kernels.reference_attention import attention_forward
from tpinv.kernels.reference_attention_bwd import attention_backward
from tpinv.ops.attention_packed import attention_packed_op, packed_backward_cuda
from tpinv.testing import assert_bits_differ, assert_same_bits, attention_inputs, pack_row, packed_conversation

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
NAMES = ("out", "lse", "dq", "dk", "dv")


def _reference_backward(do, dlse, q, k, v, out, lse, q_pos, mask, causal, window, scale, *, grad_kv_dtype=None):
    dq, dk, dv = attention_backward(do, dlse, q, k, v, out, lse, q_pos, mask, causal, window, scale)
    return dq, dk.to(grad_kv_dtype or dk.dtype), dv.to(grad_kv_dtype or dv.dtype)


@pytest.fixture
def cpu_rows(monkeypatch):
    import tpinv.kernels.triton_attention_packed_rows as run
    calls = []
    monkeypatch.setattr(run, "attention_forward_cuda", attention_forward)
    monkeypatch.setattr(run, "attention_backward_cuda",
                        lambda *a, **kw: calls.append(1) or _reference_backward(*a, **kw))
    run.calls = calls
    return run


def _rows(run, tensors, pos, mask, window=None, **kw):
    q, k, v, do, dlse = tensors
    out, lse = run.rows_forward_cuda(q, k, v, pos, pos, mask, True, window, 0.3, **kw)
    return (out, lse) + run.rows_backward_cuda(do, dlse, q, k, v, out, lse, pos, pos, mask, True, window, 0.3, **kw)


def _conversation_row(before, total):
    conv = packed_conversation((20, 3, 4), (9, 6, 5), (4, 4, 3), (True, False, True))
    parts = ([(torch.arange(before), torch.ones(before, before, dtype=torch.bool))] if before else []) + [conv]
    pos, mask, starts = pack_row(parts, total)
    return pos[None], mask[None], starts[-1], conv[0].shape[0]


def test_rows_forward_equals_packed_kernel(cpu_rows):
    pos, mask, _, _ = _conversation_row(21, 90)
    q, k, v, _, _ = attention_inputs(1, 2, 2, 90, 8, seed=0)
    ref = attention_packed_op(q, k, v, pos, pos, mask, True, None, 0.3)
    rows = cpu_rows.rows_forward_cuda(q, k, v, pos, pos, mask, True, None, 0.3, chunk_bytes=1 << 12)
    assert_same_bits(rows[0], ref[0], "out")
    assert_same_bits(rows[1], ref[1], "lse")


@pytest.mark.parametrize("window", [None, 13])
def test_rows_backward_at_any_offset_and_chunk_size(cpu_rows, window):
    """The conversation at slot 0 and at slot 37, in chunks of the virtual query axis of one slot and
    of the whole axis: the same bytes.  Control: one query's dO changed changes the shared keys' dV."""
    runs = []
    for before in (0, 37):
        pos, mask, start, n = _conversation_row(before, 120)
        tensors = attention_inputs(1, 1, 2, 120, 8, seed=1)
        conv = attention_inputs(1, 1, 2, n, 8, seed=2)
        for t, c in zip(tensors, conv):
            t[:, :, start:start + n] = c
        for chunk in (1, 1 << 30):
            runs.append((_rows(cpu_rows, tensors, pos, mask, window, chunk_bytes=chunk), start, n))
    (base, s0, n) = runs[0]
    for got, start, _ in runs[1:]:
        for name, a, b in zip(NAMES, base, got):
            assert_same_bits(b[:, :, start:start + n], a[:, :, s0:s0 + n], f"window={window}: {name}")
    pos, mask, _, _ = _conversation_row(0, 120)
    tensors = list(attention_inputs(1, 1, 2, 120, 8, seed=1))
    for t, c in zip(tensors, attention_inputs(1, 1, 2, n, 8, seed=2)):
        t[:, :, :n] = c
    tensors[3] = tensors[3].clone()
    tensors[3][:, :, n - 1] *= 2  # the last query's dO: it sees the shared prefix
    other = _rows(cpu_rows, tuple(tensors), pos, mask, window)
    assert_bits_differ(other[4][:, :, :n], base[4][:, :, :n], "dV with another dO")


def test_cuda_backward_of_general_visibility_runs_by_rows(cpu_rows):
    """The CUDA slot of the packed backward takes a general 2D mask (two contexts sharing a prefix)
    by rows: the by-rows launches run and give the by-rows gradients."""
    p, a = 5, 2
    pos = torch.cat([torch.arange(p), torch.arange(p - a, p)])[None]
    ctx = torch.cat([torch.zeros(p - a), torch.ones(a), 2 * torch.ones(a)])
    mask = ((ctx[:, None] == ctx[None, :]) | (ctx[None, :] == 0))[None]
    tensors = attention_inputs(1, 1, 1, p + a, 8, seed=3)
    rows = _rows(cpu_rows, tensors, pos, mask)
    q, k, v, do, dlse = tensors
    cpu_rows.calls.clear()
    grads = packed_backward_cuda(do, dlse, q, k, v, rows[0], rows[1], pos, pos, mask, True, None, 0.3)
    assert cpu_rows.calls, "the by-rows backward ran"
    for name, a_, b in zip(NAMES[2:], grads, rows[2:]):
        assert_same_bits(a_, b, name)


def test_by_rows_refuses_ambiguous_virtual_rows(cpu_rows):
    """Still unsupported, with a clear error: a query seeing two keys at one position."""
    pos = torch.tensor([[0, 0, 1]])
    mask = torch.ones(1, 3, 3, dtype=torch.bool)
    q, k, v, do, dlse = attention_inputs(1, 1, 1, 3, 8, seed=4)
    with pytest.raises(ValueError, match="sees several keys at position 0"):
        packed_backward_cuda(do, dlse, q, k, v, q, dlse, pos, pos, mask, True, None, 0.3)
