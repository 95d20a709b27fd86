"""On CUDA, a document packed at any offset gets the bits of the document alone, forward and backward.

``tpinv::attention_packed`` on CUDA finds the documents of per-document rows (every query sees
the causal/window part of one run of keys at positions ``0 .. L-1``) and runs each alone in a
padded batch of the Triton kernels (:mod:`tpinv.kernels.triton_attention_packed`).  Compared
byte for byte with the plain ``tpinv::attention`` of the document alone: out, lse, dq, dk, dv
(through autograd, with a gradient on lse too), bf16 and fp32, GQA, one call over four rows
that hold the document at offsets 1, 37, 64 and 200 between two others; documents gathered
into padded launches, and (a lower ``SOLO_LENGTH``) run on views of the packed tensors.  Control: the same
rows on the slot grid (no ``k_pos``), whose key-block and row-tile boundaries fall inside the
document at offset 37.  A general 2D mask (two contexts sharing a prefix) runs one query per
batch row, each context's out, lse and dq the bits of the context alone.
The last test prints (asserts nothing) the time of packed forward+backward against the
documents run alone.
"""
from __future__ import annotations

import time

import pytest
import torch

from tpinv.kernels.packed_documents import find_documents
from tpinv.ops.attention import attention
from tpinv.testing import (assert_bits_differ, assert_same_bits, attention_inputs, packed_document_rows,
                           record_ops)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OFFSETS = (1, 37, 64, 200)
NAMES = ("out", "lse", "dq", "dk", "dv")


def _run(tensors, q_pos, **kw):
    """``(out, lse, dq, dk, dv)`` through autograd, with gradients ``do`` on out and ``dlse`` on lse."""
    q, k, v, do, dlse = tensors
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(q, k, v, q_pos, return_lse=True, **kw)
    torch.autograd.backward((out, lse), (do, dlse))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _alone(tensors, row, span, **kw):
    part = tuple(t[row:row + 1, :, span].contiguous() for t in tensors)
    return _run(part, torch.arange(part[0].shape[2], device="cuda")[None], **kw)


@pytest.mark.parametrize("dtype,window,solo", [
    (torch.float32, None, 1024), (torch.float32, 19, 1024), (torch.bfloat16, None, 1024),
    (torch.bfloat16, 19, 1024), (torch.float32, None, 100), (torch.bfloat16, None, 100)],
    ids=["fp32", "fp32-window", "bf16", "bf16-window", "fp32-views", "bf16-views"])
def test_packed_documents_equal_alone_on_cuda(monkeypatch, dtype, window, solo):
    """``solo``: documents this long run alone on views of the packed tensors, shorter ones padded."""
    import tpinv.kernels.triton_attention_packed as by_documents
    monkeypatch.setattr(by_documents, "SOLO_LENGTH", solo)
    n, total, Hkv, g, D = 150, 400, 2, 4, 64
    pos, mask = packed_document_rows([(o, n, total - o - n) for o in OFFSETS], device="cuda")
    tensors = attention_inputs(len(OFFSETS), Hkv, g, total, D, 0, dtype, "cuda")
    assert find_documents(pos, pos, mask, True, window) is not None, "the per-document path must run"
    with record_ops() as log:
        packed = _run(tensors, pos, mask=mask, k_pos=pos, window=window)
    assert "tpinv::attention_packed" in log.names and "tpinv::attention_packed_backward" in log.names
    for row, o in enumerate(OFFSETS):
        for span in (slice(0, o), slice(o, o + n)):  # (the documents after: the unit tests)
            alone = _alone(tensors, row, span, window=window)
            for name, p, a in zip(NAMES, packed, alone):
                assert_same_bits(p[row:row + 1, :, span], a, f"{name} of row {row} (offset {o}), slots {span}")
    row, o = OFFSETS.index(37), 37  # control: the slot grid moves the boundaries inside the document
    slot = _run(tuple(t[row:row + 1] for t in tensors), torch.arange(total, device="cuda")[None],
                mask=mask[row:row + 1], window=window)
    alone = _alone(tensors, row, slice(o, o + n), window=window)
    assert_bits_differ(slot[1][:, :, o:o + n], alone[1], "slot-grid lse vs alone")
    assert_bits_differ(slot[3][:, :, o:o + n], alone[3], "slot-grid dk vs alone")


def test_general_mask_by_rows():
    """Two contexts sharing a prefix (multi-turn with dropped reasoning): not per-document, so each
    query runs alone as a batch row (tests/gpu/test_attention_packed_rows_cuda.py has the rest)."""
    Hkv, g, D, p, r, a = 1, 2, 64, 70, 9, 5
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, h, p + r + a, D, generator=gen).cuda() for h in (Hkv * g, Hkv, Hkv, Hkv * g))
    pos = torch.cat([torch.arange(p + r), torch.arange(p, p + a)])[None].cuda()
    ctx = torch.cat([torch.zeros(p), torch.ones(r), 2 * torch.ones(a)]).cuda()
    mask = ((ctx[:, None] == ctx[None, :]) | (ctx[None, :] == 0))[None]
    assert find_documents(pos, pos, mask, True, None) is None
    packed = _run((q, k, v, do, torch.zeros(1, Hkv * g, p + r + a, device="cuda")), pos, mask=mask, k_pos=pos)
    keep = torch.cat([torch.arange(p), torch.arange(p + r, p + r + a)]).cuda()  # context 2 alone
    part = (q[:, :, keep], k[:, :, keep], v[:, :, keep], do[:, :, keep], torch.zeros(1, Hkv * g, p + a, device="cuda"))
    alone = _run(part, torch.arange(p + a, device="cuda")[None])
    for name, x, y in zip(NAMES[:3], packed, alone):
        assert_same_bits(x[:, :, p + r:], y[:, :, p:], f"context 2 {name}")


def _timed(fn, reps=20):
    fn()  # compile / warm up
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


@pytest.mark.parametrize("lengths", [(300, 1700, 2048, 4096), (128,) * 64, (40, 500, 90, 7000, 33, 529)],
                         ids=["long", "short", "mixed"])
def test_packed_timing_against_alone(lengths):
    """Prints ms of forward+backward: packed row (documents path) vs each document alone.

    Every call passes the same ``pos``/``mask`` tensors, as a model's layers do, so the packed
    time reuses the documents found by the first call; finding them is timed on its own."""
    Hkv, g, D = 8, 4, 128
    total = sum(lengths)
    pos, mask = packed_document_rows([lengths], device="cuda")
    tensors = attention_inputs(1, Hkv, g, total, D, 5, torch.bfloat16, "cuda")
    packed_ms = _timed(lambda: _run(tensors, pos, mask=mask, k_pos=pos))
    find_ms = _timed(lambda: find_documents(pos, pos, mask, True, None))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    parts = [tuple(t[:, :, s:s + n].contiguous() for t in tensors) for s, n in zip(starts, lengths)]
    aranges = [torch.arange(n, device="cuda")[None] for n in lengths]
    alone_ms = _timed(lambda: [_run(part, ar) for part, ar in zip(parts, aranges)])
    slot_ms = _timed(lambda: _run(tensors, torch.arange(total, device="cuda")[None], mask=mask))
    print(f"\npacked attention fwd+bwd, bf16, {len(lengths)} documents {lengths[:6]}, Hq={Hkv * g} Hkv={Hkv} "
          f"D={D}: packed {packed_ms:.2f} ms (the documents kept from the first call; finding them: "
          f"{find_ms:.2f} ms once a step), documents alone "
          f"one by one {alone_ms:.2f} ms, slot grid with a block-diagonal mask {slot_ms:.2f} ms")
