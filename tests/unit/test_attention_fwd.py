"""Invariant attention forward: prefill == chunked prefill == decode, batch and padding invariance.

Invariance is asserted bitwise (``assert_same_bits``: shape, dtype and raw bytes); each test carries a negative control
showing that vanilla SDPA differs on the same kind of inputs.  bf16 controls draw fresh
inputs (up to ``CONTROL_TRIES`` times) until vanilla differs, so a control never passes
by luck of a draw and never flakes.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attention_cases import (CONTROL_TRIES, arange_pos, qkv, ragged_batch, reference, rel_err,
                             sdpa, sdpa_decode_differs, visibility)
from tpinv.kernels.reference_attention import KV_BLOCK, attention_forward
from tpinv.ops.attention import attention
from tpinv.testing import assert_bits_differ, assert_same_bits, same_bits

DTYPES = [torch.float32, torch.bfloat16]
NAN = float("nan")


def _with_garbage(x: torch.Tensor, T: int) -> torch.Tensor:
    """``x [B, H, n, D]`` in a cache of ``T`` slots whose unused slots hold NaN."""
    cache = torch.full((*x.shape[:2], T, x.shape[3]), NAN, dtype=x.dtype)
    cache[:, :, :x.shape[2]] = x
    return cache


@pytest.mark.parametrize("window", [None, 7, 80], ids=["causal", "W7", "W80"])
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_prefill_equals_decode_and_chunked_prefill(dtype, g, window):
    assert 7 < KV_BLOCK < 80  # the windows straddle the block size
    B, Hkv, S, D, T_cache = 2, 2, 83, 8, 96
    vanilla_differs = False
    for _ in range(CONTROL_TRIES):
        q, k, v = qkv(B, Hkv, g, S, S, D, dtype)
        pos = arange_pos(B, S)
        full = attention(q, k, v, pos, window=window)
        for i in range(S):  # decode: one query against the exact-length cache
            step = attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], pos[:, i:i + 1],
                             window=window)
            assert_same_bits(step, full[:, :, i:i + 1], f"decode step {i}")
        for chunk in (1, 5, 64):  # chunked prefill against a NaN-padded cache
            for c0 in range(0, S, chunk):
                c1 = min(S, c0 + chunk)
                part = attention(q[:, :, c0:c1], _with_garbage(k[:, :, :c1], T_cache),
                                 _with_garbage(v[:, :, :c1], T_cache), pos[:, c0:c1],
                                 window=window)
                assert_same_bits(part, full[:, :, c0:c1], f"chunk {chunk} at {c0}")
        if sdpa_decode_differs(q, k, v, visibility(pos, S, window=window), 16):
            vanilla_differs = True
            break
    assert vanilla_differs, "control: SDPA prefill and SDPA decode never differed"


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "W7"])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_ragged_batch_equals_each_request_alone(dtype, g, window):
    lengths, T, Hkv, D = [37, 90, 5, 64, 71], 100, 2, 8
    vanilla_differs = False
    for _ in range(CONTROL_TRIES):
        requests, (q, k, v, pos), order = ragged_batch(lengths, T, Hkv, g, D, dtype)
        batched = attention(q, k, v, pos, window=window)
        finite_k, finite_v = torch.nan_to_num(k), torch.nan_to_num(v)
        van_batched = sdpa(q, finite_k, finite_v, visibility(pos, T, window=window))
        for (rq, rk, rv), b in zip(requests, order):
            L = rq.shape[2]
            alone = attention(rq, rk, rv, arange_pos(1, L), window=window)
            assert_same_bits(alone, batched[b:b + 1, :, :L], f"request of length {L}")
            van_alone = sdpa(rq, rk, rv, visibility(arange_pos(1, L), L, window=window))
            vanilla_differs |= not same_bits(van_alone, van_batched[b:b + 1, :, :L])
        if vanilla_differs:
            break
    assert vanilla_differs, "control: SDPA batched and alone never differed"


@pytest.mark.parametrize("window", [None, 9], ids=["causal", "W9"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_packed_documents_equal_each_document_alone(dtype, window):
    # Documents start on the absolute KV-block grid: doc 1 at slot 0, doc 2 at slot 2*KV_BLOCK.
    L1, L2, start2, Hkv, g, D = 100, 45, 2 * KV_BLOCK, 4, 2, 32
    T = start2 + L2
    vanilla_differs = False
    for _ in range(CONTROL_TRIES):
        q1, k1, v1 = qkv(1, Hkv, g, L1, L1, D, dtype)
        q2, k2, v2 = qkv(1, Hkv, g, L2, L2, D, dtype)
        filler = qkv(1, Hkv, g, start2 - L1, start2 - L1, D, dtype)
        q, k, v = (torch.cat([a, f, b], 2) for a, f, b in zip((q1, k1, v1), filler, (q2, k2, v2)))
        doc = torch.zeros(T, dtype=torch.int64)
        doc[L1:start2], doc[start2:] = 1, 2
        mask = (doc[:, None] == doc[None, :])[None]
        pos = arange_pos(1, T)
        packed = attention(q, k, v, pos, mask=mask, window=window)
        alone1 = attention(q1, k1, v1, arange_pos(1, L1), window=window)
        alone2 = attention(q2, k2, v2, arange_pos(1, L2), window=window)
        assert_same_bits(alone1, packed[:, :, :L1], 'alone1')
        assert_same_bits(alone2, packed[:, :, start2:], 'alone2')
        van_packed = sdpa(q, k, v, visibility(pos, T, window=window, mask=mask))
        van_alone = [sdpa(a, b, c, visibility(arange_pos(1, L), L, window=window))
                     for (a, b, c), L in (((q1, k1, v1), L1), ((q2, k2, v2), L2))]
        if not (same_bits(van_alone[0], van_packed[:, :, :L1])
                and same_bits(van_alone[1], van_packed[:, :, start2:])):
            vanilla_differs = True
            break
    assert vanilla_differs, "control: SDPA packed and alone never differed"


def _random_mask(B: int, S: int, T: int, empty_block: int) -> torch.Tensor:
    """A random bool mask that hides all of KV block ``empty_block`` and some whole rows."""
    mask = torch.rand(B, S, T) < 0.8
    mask[:, :, empty_block * KV_BLOCK:(empty_block + 1) * KV_BLOCK] = False
    mask[:, ::7] = False
    return mask


@pytest.mark.parametrize("window", [None, 5, 70], ids=["causal", "W5", "W70"])
def test_skipped_blocks_and_chunking_give_the_same_bits(window):
    B, Hkv, g, S, T, D = 2, 2, 2, 24, 600, 8
    vanilla_differs = False
    for _ in range(CONTROL_TRIES):
        q, k, v = qkv(B, Hkv, g, S, T, D, torch.float32)
        pos = torch.randint(0, 400, (B, S))
        pos[0, 0] = T + 5  # a query past the end sees every slot
        mask = _random_mask(B, S, T, empty_block=1)
        ref = attention_forward(q, k, v, pos, mask, True, window)
        for kw in (dict(skip_blocks=False), dict(query_chunk=1), dict(query_chunk=7, chunk_bytes=1),
                   dict(chunk_bytes=3 * KV_BLOCK * D * 4 * g)):
            out = attention_forward(q, k, v, pos, mask, True, window, **kw)
            assert_same_bits(out[0], ref[0], str(kw))
            assert_same_bits(out[1], ref[1], str(kw))
        # control: vanilla attention over the keys up to the last visible one vs all keys
        # (SDPA's CPU kernel splits keys by 512, so all keys take one more split)
        pos[0, 0] = 0
        vis = visibility(pos, T, window=window)
        hi = int(pos.max()) + 1
        if not same_bits(sdpa(q, k, v, vis), sdpa(q, k[:, :, :hi], v[:, :, :hi], vis[:, :, :hi])):
            vanilla_differs = True
            break
    assert vanilla_differs, "control: SDPA over all keys and over the needed keys never differed"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)],
                         ids=["fp32", "bf16"])
def test_forward_parity_with_fp64_reference(dtype, tol):
    B, Hkv, g, S, T, D = 2, 2, 3, 37, 150, 16
    q, k, v = qkv(B, Hkv, g, S, T, D, dtype)
    pos = torch.randint(-2, T, (B, S))
    pos[:, 0] = -1  # sees no key
    mask = _random_mask(B, S, T, empty_block=0)
    for window, m in ((None, None), (33, None), (None, mask), (90, mask)):
        vis = visibility(pos, T, window=window, mask=m)
        out, lse = attention(q, k, v, pos, window=window, mask=m, return_lse=True, scale=0.3)
        ref_out, ref_lse = reference(q, k, v, vis, scale=0.3)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert rel_err(out, ref_out) < tol
        seen = vis.any(-1)[:, None, :].expand_as(lse)
        assert rel_err(lse[seen], ref_lse[seen]) < tol
        assert_same_bits(lse[~seen], torch.full_like(lse[~seen], float("-inf")), 'lse[~seen]')
        assert not torch.isnan(out).any()
        blank = out[~seen]  # rows that see no key are +0 exactly
        assert blank.numel() > 0 and (blank == 0).all() and not torch.signbit(blank).any()


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 3), Hkv=st.integers(1, 2), g=st.sampled_from([1, 2, 3]),
       S=st.integers(1, 20), extra=st.integers(0, 80), D=st.sampled_from([3, 4, 8]),
       window=st.sampled_from([None, 1, 6, 65]), data=st.data())
def test_any_query_slice_and_batch_subset_is_bit_identical(B, Hkv, g, S, extra, D, window, data):
    T = S + extra
    q, k, v = qkv(B, Hkv, g, S, T, D, torch.float32)
    pos = torch.sort(torch.randint(0, T, (B, S)), dim=1).values
    full = attention(q, k, v, pos, window=window)
    i0 = data.draw(st.integers(0, S - 1))
    i1 = data.draw(st.integers(i0 + 1, S))
    b = data.draw(st.integers(0, B - 1))
    part = attention(q[b:b + 1, :, i0:i1], k[b:b + 1], v[b:b + 1], pos[b:b + 1, i0:i1],
                     window=window)
    assert_same_bits(part, full[b:b + 1, :, i0:i1], 'part')


def test_query_slice_control_vanilla_differs():
    """Control beside the slice property: vanilla SDPA on query slices differs from one call."""
    q, k, v = qkv(3, 2, 2, 20, 100, 8, torch.float32)
    pos = arange_pos(3, 20, start=80)
    vis = visibility(pos, 100)
    full = sdpa(q, k, v, vis)
    parts = torch.cat([sdpa(q[:, :, i:i + 1], k, v, vis[:, i:i + 1]) for i in range(20)], 2)
    assert_bits_differ(full, parts, 'full')
