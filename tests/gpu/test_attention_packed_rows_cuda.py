"""On CUDA, a multi-turn conversation packed with a general 2D mask: forward and backward by rows.

``tpinv::attention_packed`` runs each query of a row that is not per-document alone as one batch
row of the Triton kernels (:mod:`tpinv.kernels.triton_attention_packed_rows`) and adds each key's
dK/dV by halving over the virtual query axis.  Through autograd (a gradient on lse too), bf16 and
fp32, GQA, with and without a window, byte for byte: the conversation (three turns, the first's
reasoning dropped from later turns) at slot 0 and at slot 37; alone and as row 2 of four rows;
all heads and the first half of the Q and KV heads; each query's out, lse and dq against the
plain ``tpinv::attention`` of its turn's context alone.  Controls, by construction: the slot
grid (no ``k_pos``) moves the conversation's key-block boundaries (lse differs); a key seen by four
queries with dV contributions 1, 2^-24, 0, 2^-24 gets ``1 + 2^-23`` (halving), not ``1`` (the chain).
The interpreter twin is ``tests/unit/test_triton_attention_packed_rows_interp.py``.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.kernels.packed_documents import find_documents
from tpinv.testing import (assert_bits_differ, assert_same_bits, attention_inputs, pack_row, packed_conversation,
                           place_row, record_ops)

from test_attention_packed_cuda import NAMES, _run  # the same autograd run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TURNS = dict(user=(150, 20, 30), reasoning=(60, 40, 25), answer=(30, 20, 15), drop=(True, False, True))
CASES = [(torch.float32, None), (torch.float32, 37), (torch.bfloat16, None), (torch.bfloat16, 37)]
IDS = ["fp32", "fp32-window", "bf16", "bf16-window"]


def _packed(tensors, pos, mask, window):
    assert find_documents(pos, pos, mask, True, window) is None, "a general 2D mask: the by-rows path"
    with record_ops() as log:
        got = _run(tensors, pos, mask=mask, k_pos=pos, window=window)
    assert "tpinv::attention_packed_backward" in log.names
    return got


def _doc(n):
    return torch.arange(n), torch.ones(n, n, dtype=torch.bool)


@pytest.mark.parametrize("dtype,window", CASES, ids=IDS)
def test_offset_batch_and_heads(dtype, window):
    conv_pos, conv_mask = packed_conversation(**TURNS)
    n, total, Hkv, g, D = conv_pos.shape[0], 600, 2, 4, 64
    conv = attention_inputs(1, Hkv, g, n, D, 0, dtype, "cuda")
    runs = {}
    # at slot 37 in a longer row whose last document reaches position 442 (> the conversation's 329)
    layouts = (("slot 0", [(conv_pos, conv_mask)], 0, total), ("slot 37", [_doc(37), (conv_pos, conv_mask)], 37, 900))
    for name, parts, start, length in layouts:
        pos, mask, _ = pack_row(parts, length, device="cuda")
        tensors = place_row(attention_inputs(1, Hkv, g, length, D, 1, dtype, "cuda"), conv, 0, start)
        runs[name] = (_packed(tensors, pos[None], mask[None], window), start)
    alone = _packed(conv, conv_pos[None].cuda(), conv_mask[None].cuda(), window)
    other = packed_conversation((40, 9, 9), (50, 9, 9), (9, 9, 9), (False, True, False))
    rows = [pack_row([_doc(300)], total), pack_row([other], total),
            pack_row([_doc(11), (conv_pos, conv_mask)], total), pack_row([], total)]
    pos = torch.stack([r[0] for r in rows]).cuda()
    mask = torch.stack([r[1] for r in rows]).cuda()
    tensors = place_row(attention_inputs(4, Hkv, g, total, D, 2, dtype, "cuda"), conv, 2, 11)
    batch = _packed(tensors, pos, mask, window)
    heads = (Hkv * g // 2, Hkv // 2, Hkv // 2, Hkv * g // 2, Hkv * g // 2)  # q, k, v, dO, dlse
    half = _packed(tuple(t[:, :h] for t, h in zip(tensors, heads)), pos, mask, window)
    for i, name in enumerate(NAMES):
        a = alone[i]
        for what, (got, start) in runs.items():
            assert_same_bits(got[i][:, :, start:start + n], a, f"{name}: {what} vs alone")
        assert_same_bits(batch[i][2:3, :, 11:11 + n], a, f"{name}: row 2 of 4 vs alone")
        assert_same_bits(half[i], batch[i][:, :half[i].shape[1]], f"{name}: half the heads vs all")
    # Control: the slot grid moves the conversation's key-block boundaries.
    pos, mask, _ = pack_row([_doc(37), (conv_pos, conv_mask)], total, device="cuda")
    tensors = place_row(attention_inputs(1, Hkv, g, total, D, 1, dtype, "cuda"), conv, 0, 37)
    slot = _run(tensors, torch.arange(total, device="cuda")[None],
                mask=(mask & (pos[None, :] <= pos[:, None]))[None], window=window)
    assert_bits_differ(slot[1][:, :, 37:37 + n], alone[1], "slot-grid lse vs alone")


@pytest.mark.parametrize("dtype,window", CASES, ids=IDS)
def test_queries_equal_their_context_alone(dtype, window):
    conv_pos, conv_mask = packed_conversation(**TURNS)
    n, Hkv, g, D = conv_pos.shape[0], 2, 2, 128
    pos, mask, _ = pack_row([_doc(37), (conv_pos, conv_mask)], 37 + n, device="cuda")
    tensors = attention_inputs(1, Hkv, g, 37 + n, D, 4, dtype, "cuda")
    packed = _packed(tensors, pos[None], mask[None], window)
    ctx = [set(conv_mask[i].nonzero().flatten().tolist()) for i in range(n)]
    turns = [sorted(c) for c in {frozenset(c): None for c in ctx if not any(c < o for o in ctx)}]
    checked = set()
    for turn in turns:
        slots = torch.tensor(turn, device="cuda") + 37
        alone = _run(tuple(t[:, :, slots] for t in tensors), torch.arange(len(turn), device="cuda")[None],
                     window=window)
        members = [i for i in turn if ctx[i] <= set(turn)]
        at = torch.tensor([turn.index(i) for i in members], device="cuda")
        for name, p, a in zip(NAMES[:3], packed, alone):
            assert_same_bits(p[:, :, torch.tensor(members, device="cuda") + 37], a[:, :, at], f"{name}")
        checked |= set(members)
    assert checked == set(range(n))


def test_key_sum_is_the_halving_not_the_chain():
    """Key 0 seen by four queries at positions 0..3 that see only it (p = 1: dV contributions = dO)."""
    T, D = 4, 64
    pos = torch.arange(T, device="cuda")[None]
    mask = torch.zeros(1, T, T, dtype=torch.bool, device="cuda")
    mask[0, :, 0] = True
    q, k, v, _, _ = attention_inputs(1, 1, 1, T, D, 5, torch.float32, "cuda")
    do = torch.tensor([1.0, 2.0 ** -24, 0.0, 2.0 ** -24], device="cuda")[None, None, :, None].expand(1, 1, T, D)
    got = _packed((q, k, v, do.contiguous(), torch.zeros(1, 1, T, device="cuda")), pos, mask, None)
    assert_same_bits(got[4][0, 0, 0], torch.full((D,), 1.0 + 2.0 ** -23, device="cuda"), "(1 + 0) + (2^-24 + 2^-24)")
    chain = ((do[0, 0, 0] + do[0, 0, 1]) + do[0, 0, 2]) + do[0, 0, 3]
    assert_bits_differ(chain, got[4][0, 0, 0], "the chain in slot order vs the halving")
