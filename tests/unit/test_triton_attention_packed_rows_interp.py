"""Packed attention by rows (a general 2D mask) on the Triton kernels, under Triton's interpreter (CPU).

:mod:`tpinv.kernels.triton_attention_packed_rows` runs each query alone as one batch row against
its virtual row, and adds a key's dK/dV contributions by halving over the virtual query axis.
The row is a conversation of three turns packed by ``pack_conversations`` (turn 1's reasoning
dropped from later turns: turn 2 restates turn 1's answer at new positions), its positions
crossing the 64-key block.  Byte for byte:

* offsets: the conversation at slot 0 and at slot 37 (a document before it): out, lse, dq, dk, dv;
* batch: the conversation alone (batch 1, a row of its own length) and as row 2 of four rows;
* heads (what TP relies on): all heads and the first half of the Q and KV heads;
* each query's out, lse and dq equal the plain Triton forward and backward of its rollout
  context alone (the turn's tokens, contiguous, positions ``0 .. L-1``, causal);
* dK/dV equal the contiguous halving over the virtual query axis of the per-query contributions
  (built here from the per-query launches, unchunked), at any chunk size.

Controls, by construction: a key seen by four queries (each seeing only it, so its dV contributions
are exactly the queries' ``dO``: 1, 2^-24, 0, 2^-24) gets ``1 + 2^-23`` from the halving and ``1``
from the chain in slot order, and the kernel returns the halving's bits; the slot grid (no
virtual positions) moves the key-block boundaries of the conversation at slot 37, and its lse differs.
fp32 and fp16 (bf16 is not reliable in the interpreter); the GPU twin is
``tests/gpu/test_attention_packed_rows_cuda.py``.
"""
from __future__ import annotations

import importlib.util
import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from triton_interp import interpreted_test, main, seeded_checks  # noqa: E402
from tpinv.testing import (assert_bits_differ, assert_same_bits, pack_row, packed_conversation,  # noqa: E402
                           place_row)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
NAMES = ("out", "lse", "dq", "dk", "dv")
SCALE = 0.25
TURNS = dict(user=(40, 3, 4), reasoning=(9, 6, 5), answer=(4, 4, 3), drop=(True, False, False))


def _conversation():
    return packed_conversation(**TURNS)


def _random(shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _tensors(B, Hkv, g, T, D, dtype, seed):
    """``(q, k, v, dO, dlse)`` of ``B`` rows of ``T`` slots."""
    return (_random((B, Hkv * g, T, D), dtype, seed), _random((B, Hkv, T, D), dtype, seed + 1),
            _random((B, Hkv, T, D), dtype, seed + 2), _random((B, Hkv * g, T, D), dtype, seed + 3),
            _random((B, Hkv * g, T), torch.float32, seed + 4))


def _rows(tensors, pos, mask, window=None, chunk_bytes=None):
    """``(out, lse, dq, dk, dv)`` of the by-rows kernels (the path a general mask takes on CUDA)."""
    from tpinv.kernels.packed_documents import find_documents
    from tpinv.kernels.triton_attention_packed_rows import ROWS_BYTES, rows_backward_cuda, rows_forward_cuda
    assert find_documents(pos, pos, mask, True, window) is None, "a general 2D mask: the by-rows path"
    q, k, v, do, dlse = tensors
    out, lse = rows_forward_cuda(q, k, v, pos, pos, mask, True, window, SCALE)
    grads = rows_backward_cuda(do, dlse, q, k, v, out, lse, pos, pos, mask, True, window, SCALE,
                               chunk_bytes=chunk_bytes or ROWS_BYTES)
    return (out, lse) + grads


def _plain(tensors, q_pos, mask, window):
    from tpinv.kernels.triton_attention import attention_forward_cuda
    from tpinv.kernels.triton_attention_bwd import attention_backward_cuda
    q, k, v, do, dlse = tensors
    out, lse = attention_forward_cuda(q, k, v, q_pos, mask, True, window, SCALE)
    return (out, lse) + attention_backward_cuda(do, dlse, q, k, v, out, lse, q_pos, mask, True, window, SCALE)


def _same_span(a, b, span_a, span_b, what, heads=slice(None)):
    for name, x, y in zip(NAMES, a, b):
        assert_same_bits(x[span_a[0]:span_a[0] + 1, heads, span_a[1]], y[span_b[0]:span_b[0] + 1, heads, span_b[1]],
                         f"{what}: {name}")


def _offsets(dtype, window):
    conv_pos, conv_mask = _conversation()
    n = conv_pos.shape[0]
    conv = _tensors(1, 1, 2, n, 16, dtype, seed=0)
    at0 = pack_row([(conv_pos, conv_mask)], 125)
    # a longer row whose last document reaches position 80 (> the conversation's 68): another virtual row length
    at37 = pack_row([(torch.arange(37), torch.ones(37, 37, dtype=torch.bool)), (conv_pos, conv_mask)], 200)
    assert at37[2] == [0, 37] and int(at37[0].max()) == 80
    runs = []
    for pos, mask, starts in (at0, at37):
        tensors = place_row(_tensors(1, 1, 2, pos.shape[0], 16, dtype, seed=5), conv, 0, starts[-1])
        runs.append(_rows(tensors, pos[None], mask[None], window))
    _same_span(runs[0], runs[1], (0, slice(0, n)), (0, slice(37, 37 + n)), f"{dtype} window={window}, slot 0 vs 37")
    return at37, conv, runs[1]


def check_offsets_fp32():
    (pos, mask, _), conv, rows = _offsets(torch.float32, None)
    # Control: the slot grid (no virtual positions) moves the conversation's key-block boundaries.
    tensors = place_row(_tensors(1, 1, 2, pos.shape[0], 16, torch.float32, seed=5), conv, 0, 37)
    slot = _plain(tensors, torch.arange(pos.shape[0])[None], mask[None] & (pos[None, :] <= pos[:, None])[None], None)
    n = conv[0].shape[2]
    assert_bits_differ(slot[1][:, :, 37:37 + n], rows[1][:, :, 37:37 + n], "slot-grid lse vs by rows")


def check_offsets_fp16_window():
    _offsets(torch.float16, 19)


def check_batch():
    conv_pos, conv_mask = _conversation()
    n, total = conv_pos.shape[0], 96
    conv = _tensors(1, 1, 2, n, 16, torch.float32, seed=0)
    alone = _rows(conv, conv_pos[None], conv_mask[None])
    other = packed_conversation((5, 20, 2), (20, 3, 7), (6, 6, 6), (False, True, False))
    rows = [pack_row([other], total), pack_row([(torch.arange(50), torch.ones(50, 50, dtype=torch.bool))], total),
            pack_row([(torch.arange(11), torch.ones(11, 11, dtype=torch.bool)), (conv_pos, conv_mask)], total),
            pack_row([], total)]
    pos = torch.stack([r[0] for r in rows])
    mask = torch.stack([r[1] for r in rows])
    tensors = place_row(_tensors(4, 1, 2, total, 16, torch.float32, seed=9), conv, 2, 11)
    batch = _rows(tensors, pos, mask)
    _same_span(alone, batch, (0, slice(0, n)), (2, slice(11, 11 + n)), "alone vs row 2 of 4")


def check_heads():
    """All heads, and the first half of the Q and KV heads (a TP shard): the same bytes for those heads."""
    conv_pos, conv_mask = _conversation()
    pos, mask, _ = pack_row([(torch.arange(37), torch.ones(37, 37, dtype=torch.bool)), (conv_pos, conv_mask)], 130)
    tensors = _tensors(1, 2, 2, 130, 32, torch.float32, seed=3)
    full = _rows(tensors, pos[None], mask[None], window=23)
    q, k, v, do, dlse = tensors
    half = _rows((q[:, :2], k[:, :1], v[:, :1], do[:, :2], dlse[:, :2]), pos[None], mask[None], window=23)
    for name, f, h in zip(NAMES, full, half):
        assert_same_bits(f[:, :h.shape[1]], h, f"{name}: all heads vs the first half")


def _contexts(mask):
    """Each query's context (the slots its mask row shows, in slot order) and the maximal ones (the turns)."""
    ctx = [set(mask[i].nonzero().flatten().tolist()) for i in range(mask.shape[0])]
    turns = [c for c in ctx if not any(c < o for o in ctx)]
    return ctx, [sorted(c) for c in {frozenset(c): None for c in turns}]


def _queries_alone(dtype, window):
    conv_pos, conv_mask = _conversation()
    n = conv_pos.shape[0]
    pos, mask, _ = pack_row([(torch.arange(37), torch.ones(37, 37, dtype=torch.bool)), (conv_pos, conv_mask)], 37 + n)
    tensors = _tensors(1, 1, 2, 37 + n, 16, dtype, seed=4)
    rows = _rows(tensors, pos[None], mask[None], window)
    ctx, turns = _contexts(conv_mask)
    checked = set()
    for turn in turns:
        slots = torch.tensor(turn) + 37
        assert_same_bits(pos[slots], torch.arange(len(turn)), "a turn's context at positions 0 .. L-1")
        alone = _plain(tuple(t[:, :, slots] for t in tensors), torch.arange(len(turn))[None], None, window)
        members = [i for i in turn if ctx[i] <= set(turn)]   # the queries whose context is a prefix of the turn
        at = torch.tensor([turn.index(i) for i in members])
        for name, r, a in zip(NAMES[:3], rows, alone):
            assert_same_bits(r[:, :, torch.tensor(members) + 37], a[:, :, at], f"{dtype} window={window}: {name}")
        checked |= set(members)
    assert checked == set(range(n)), "every query checked against its context alone"
    assert len(turns) == 2, "turn 1, and turn 3 (turn 2 keeps its reasoning: its context is a prefix of turn 3's)"


def check_queries_equal_their_context_alone_fp32():
    _queries_alone(torch.float32, None)


def check_queries_equal_their_context_alone_fp16_window():
    _queries_alone(torch.float16, 19)


def _contributions(tensors, pos, mask, out, lse):
    """Per-query fp32 dK, dV ``[S, Hkv, Tv, D]`` of row 0 from one launch per query, and their key slots."""
    from tpinv.kernels.reference_attention_packed import virtual_slots, visible
    from tpinv.kernels.triton_attention_bwd import attention_backward_cuda
    from tpinv.kernels.triton_attention_packed_rows import VirtualRows
    q, k, v, do, dlse = tensors
    slots = virtual_slots(visible(pos[0], pos[0], mask[0], True, None), pos[0])
    dks, dvs = [], []
    for i in range(pos.shape[1]):
        rows = VirtualRows(0, torch.tensor([i]), slots, pos)
        _, dk, dv = attention_backward_cuda(rows.queries(do), rows.queries(dlse), rows.queries(q), rows.keys(k),
                                            rows.keys(v), rows.queries(out), rows.queries(lse), rows.q_pos,
                                            rows.mask, True, None, SCALE, grad_kv_dtype=torch.float32)
        dks.append(dk)
        dvs.append(dv)
    return torch.cat(dks), torch.cat(dvs), slots


def _key_sums(contrib, slots, order, T):
    """``[Hkv, T, D]``: each key's contributions, on the axis ``order`` gives each query, by halving (and chained)."""
    from tpinv.kernels.reference_attention import halve
    S, Hkv, _, D = contrib.shape
    dense = contrib.new_zeros((int(order.max()) + 1, T, Hkv, D))
    i, p = (slots >= 0).nonzero(as_tuple=True)
    dense[order[i], slots[i, p]] = contrib[i, :, p]
    chain = dense[0]
    for x in dense[1:]:
        chain = chain + x
    return (halve(dense, 0) + 0.0).transpose(0, 1), (chain + 0.0).transpose(0, 1)


def check_key_sums_halve_the_virtual_query_axis_at_any_chunk_size():
    from tpinv.kernels.reference_attention_packed import query_slots
    from tpinv.kernels.reference_attention import next_pow2
    conv_pos, conv_mask = _conversation()
    pos, mask = conv_pos[None], conv_mask[None]
    tensors = _tensors(1, 1, 2, pos.shape[1], 16, torch.float32, seed=6)
    whole = _rows(tensors, pos, mask)
    dks, dvs, slots = _contributions(tensors, pos, mask, whole[0], whole[1])
    qs, length = query_slots(pos[0])
    assert length == 256 and int(qs.max()) >= 128, "the restated answer sits on the second layer"
    for name, got, contrib in (("dk", whole[3], dks), ("dv", whole[4], dvs)):
        tree, _ = _key_sums(contrib, slots, qs, pos.shape[1])
        assert_same_bits(got[0], tree, f"{name}: halving over the virtual query axis")
    per_slot = 2 * (slots.shape[1] + pos.shape[1]) * 16 * 4
    for width in (4, 64):   # chunks of 4 and 64 slots of the axis (256 slots)
        chunked = _rows(tensors, pos, mask, chunk_bytes=width * per_slot)
        assert next_pow2(width) == width
        for name, a, b in zip(NAMES, whole, chunked):
            assert_same_bits(b, a, f"{name}: chunks of {width} slots vs one chunk")


def check_key_sum_is_the_halving_not_the_chain():
    """Control: key 0 seen by four queries at positions 0..3 (each sees only it: p = 1, so its dV
    contributions are the queries' dO exactly): halving (1 + 0) + (2^-24 + 2^-24) = 1 + 2^-23, the chain
    in slot order ((1 + 2^-24) + 0) + 2^-24 = 1."""
    T, D = 4, 16
    pos = torch.arange(T)[None]
    mask = torch.zeros(1, T, T, dtype=torch.bool)
    mask[0, :, 0] = True
    q, k, v = (_random((1, 1, T, D), torch.float32, s) for s in (1, 2, 3))
    do = torch.tensor([1.0, 2.0 ** -24, 0.0, 2.0 ** -24])[None, None, :, None].expand(1, 1, T, D).contiguous()
    rows = _rows((q, k, v, do, torch.zeros(1, 1, T)), pos, mask)
    dvs = _contributions((q, k, v, do, torch.zeros(1, 1, T)), pos, mask, rows[0], rows[1])[1]
    assert_same_bits(dvs[:, 0, 0], do[0, 0], "each query's dV contribution is its dO")
    tree, chain = _key_sums(dvs, torch.zeros(T, 1, dtype=torch.int64), torch.arange(T), T)
    assert_same_bits(rows[4][0, 0, 0], torch.full((D,), 1.0 + 2.0 ** -23), "halving: (1 + 0) + (2^-24 + 2^-24)")
    assert_same_bits(tree, rows[4][0], "the kernel's dV is the halving")
    assert_bits_differ(chain, rows[4][0], "chain in slot order vs halving")


CHECKS = seeded_checks(dict(globals()))
#: Checks that take more than ~20 s under the interpreter (one process each).
SLOW = ("check_offsets_fp32", "check_offsets_fp16_window", "check_batch", "check_heads",
        "check_key_sums_halve_the_virtual_query_axis_at_any_chunk_size")
test_interpreter = interpreted_test(__file__, {n: c for n, c in CHECKS.items() if n not in SLOW},
                                    process_per_check=True)
test_interpreter_slow = pytest.mark.slow(interpreted_test(__file__, {n: CHECKS[n] for n in SLOW},
                                                          process_per_check=True))

if __name__ == "__main__":
    main(CHECKS)
