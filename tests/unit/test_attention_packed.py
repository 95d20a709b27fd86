"""Packed rows: a document at any offset of a row gives the bits it gets alone.

``k_pos`` puts each key a query sees at the slot of its own position, so the key-block grid
starts at the document's position 0 wherever the document sits in the row.  Forward and
backward are compared byte for byte with the document run alone; the control packs the
same document with the slot grid (no ``k_pos``, positions = slots), whose block boundaries
fall elsewhere in the document (a different summation order by construction).
"""
from __future__ import annotations

import pytest
import torch

from tpinv.kernels.reference_attention import KV_BLOCK
from tpinv.ops.attention import attention
from tpinv.testing import assert_bits_differ, assert_same_bits, record_ops


def _doc_inputs(n, Hkv, g, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hkv * g, n, D, generator=gen).to(dtype)
    k = torch.randn(1, Hkv, n, D, generator=gen).to(dtype)
    v = torch.randn(1, Hkv, n, D, generator=gen).to(dtype)
    do = torch.randn(1, Hkv * g, n, D, generator=gen).to(dtype)
    return q, k, v, do


def _run(q, k, v, do, q_pos, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(q, k, v, q_pos, return_lse=True, **kw)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad, lse.detach()


def _pack(offset, tensors, pad_n, fill):
    """Place ``[1, H, n, D]`` tensors at ``offset`` of a row of ``pad_n`` slots (noise around)."""
    out = []
    for i, t in enumerate(tensors):
        row = fill(i, t.shape[:2] + (pad_n,) + t.shape[3:]).to(t.dtype)
        row[:, :, offset:offset + t.shape[2]] = t
        out.append(row)
    return out


@pytest.mark.parametrize("offset,window,dtype", [
    (1, None, torch.float32), (101, 19, torch.float32), (64, None, torch.float32),
    (37, None, torch.bfloat16), (101, 19, torch.bfloat16)])
def test_document_at_any_offset_equals_alone(offset, window, dtype):
    n, Hkv, g, D = 83, 2, 2, 8  # the document spans a block boundary (83 > KV_BLOCK)
    assert n > KV_BLOCK
    q, k, v, do = _doc_inputs(n, Hkv, g, D, dtype, seed=offset)
    alone = _run(q, k, v, do, torch.arange(n)[None], window=window)
    total = offset + n + 29
    gen = torch.Generator().manual_seed(1000 + offset)
    packed_in = _pack(offset, (q, k, v, do), total, lambda i, s: torch.randn(s, generator=gen))
    pos = torch.zeros(1, total, dtype=torch.int64)
    doc = torch.zeros(1, total, dtype=torch.int64)
    pos[0, :offset] = torch.arange(offset)  # a document before, one after
    pos[0, offset:offset + n] = torch.arange(n)
    pos[0, offset + n:] = torch.arange(total - offset - n)
    doc[0, offset:offset + n], doc[0, offset + n:] = 1, 2
    mask = doc[:, :, None] == doc[:, None, :]
    with record_ops() as log:
        packed = _run(*packed_in, pos, window=window, mask=mask, k_pos=pos)
    assert "tpinv::attention_packed" in log.names and "tpinv::attention_packed_backward" in log.names
    span = slice(offset, offset + n)
    for name, a, p in zip(("out", "dq", "dk", "dv", "lse"), alone, packed):
        assert_same_bits(p[:, :, span], a, f"{name} of the document at offset {offset}")
    # Control: the slot grid (positions = slots, causal by slot) packs the document with the
    # block boundary at slot 64, i.e. at document position 64 - offset: another order.
    slot_pos = torch.arange(total)[None]
    control = _run(*packed_in, slot_pos, window=window, mask=mask)
    if offset % KV_BLOCK:
        assert_bits_differ(control[4][:, :, span], alone[4],  # fp32 lse: no rounding hides it
                           "slot-grid packing (block boundary moved) vs alone")
    else:  # a multiple of the block: even the slot grid lines up with the document's own
        assert_same_bits(control[4][:, :, span], alone[4], "slot grid at a block multiple")


def test_keys_sharing_a_position_raise():
    q, k, v, _ = _doc_inputs(4, 1, 1, 8, torch.float32, 0)
    pos = torch.tensor([[0, 1, 1, 2]])
    with pytest.raises(ValueError, match="several keys at position 1"):
        attention(q, k, v, pos, k_pos=pos)


def test_bad_k_pos_raises():
    q, k, v, _ = _doc_inputs(4, 1, 1, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="k_pos must be an int64"):
        attention(q, k, v, torch.arange(4)[None], k_pos=torch.arange(4))


def test_two_contexts_sharing_a_prefix_match_each_context_alone():
    """A row holding prefix P, then R (context 1 = P+R) and A at R's positions (context 2 = P+A).

    Every query's output and dq equal its context alone; the keys of A (seen by context 2 only,
    whose queries share positions with R's and so sit on the second layer of the virtual query
    axis) get the dk/dv of context 2 alone.
    """
    Hkv, g, D, p, r, a = 1, 2, 8, 70, 9, 5
    gen = torch.Generator().manual_seed(3)

    def rand(n):
        return [torch.randn(1, h, n, D, generator=gen) for h in (Hkv * g, Hkv, Hkv, Hkv * g)]

    P, R, A = rand(p), rand(r), rand(a)
    row = [torch.cat([x, y, z], 2) for x, y, z in zip(P, R, A)]
    pos = torch.cat([torch.arange(p + r), torch.arange(p, p + a)])[None]
    ctx = torch.cat([torch.zeros(p), torch.ones(r), 2 * torch.ones(a)])
    mask = (ctx[:, None] == ctx[None, :]) | (ctx[None, :] == 0)
    packed = _run(*row, pos, mask=mask[None], k_pos=pos)
    alone2 = _run(*[torch.cat([x, z], 2) for x, z in zip(P, A)], torch.arange(p + a)[None])
    alone1 = _run(*[torch.cat([x, y], 2) for x, y in zip(P, R)], torch.arange(p + r)[None])
    tail = slice(p + r, p + r + a)
    for i, name in ((0, "out"), (1, "dq"), (4, "lse")):
        assert_same_bits(packed[i][:, :, tail], alone2[i][:, :, p:], f"context 2 {name}")
        assert_same_bits(packed[i][:, :, p:p + r], alone1[i][:, :, p:], f"context 1 {name}")
    for i, name in ((2, "dk"), (3, "dv")):
        assert_same_bits(packed[i][:, :, tail], alone2[i][:, :, p:], f"context 2 keys {name}")
    # Control: the prefix keys gather gradient from both contexts, so they differ from either alone.
    assert_bits_differ(packed[2][:, :, :p], alone2[2][:, :, :p], "shared prefix dk vs context 2 alone")
