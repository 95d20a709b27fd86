"""Invariant attention backward: a request's gradients are the same bits alone or padded in a batch.

Invariance is asserted bitwise (``assert_same_bits``: shape, dtype and raw bytes) next to a negative control showing that
vanilla SDPA's gradients differ in the same comparison (bf16 controls redraw inputs up to
``CONTROL_TRIES`` times until vanilla differs).  Parity with an fp64 reference uses a
relative Frobenius error of 1e-5 (fp32) and 2e-2 (bf16).
"""
from __future__ import annotations

import pytest
import torch

from attention_cases import (CONTROL_TRIES, arange_pos, qkv, randn, ragged_batch, reference,
                             rel_err, sdpa, visibility)
from tpinv.kernels.reference_attention import KV_BLOCK, attention_forward
from tpinv.kernels.reference_attention_bwd import attention_backward
from tpinv.ops.attention import attention
from tpinv.testing import assert_bits_differ, assert_same_bits, same_bits

DTYPES = [torch.float32, torch.bfloat16]


def _grads(fn, q, k, v, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)


def _ours(pos, window=None, mask=None):
    return lambda q, k, v: attention(q, k, v, pos, window=window, mask=mask)


def _vanilla(pos, T, window=None, mask=None):
    vis = visibility(pos, T, window=window, mask=mask)
    return lambda q, k, v: sdpa(q, k, v, vis)


@pytest.mark.parametrize("window", [None, 6], ids=["causal", "W6"])
@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_grads_alone_equal_grads_in_padded_batch(dtype, g, window):
    lengths, T, Hkv, D = [37, 90, 5, 71], 96, 2, 8
    vanilla_differs = False
    for _ in range(CONTROL_TRIES):
        requests, (q, k, v, pos), order = ragged_batch(lengths, T, Hkv, g, D, dtype, garbage=0.5)
        k[:, :, -6:] = randn(len(lengths), Hkv, 6, D, dtype=dtype)  # slots past every request
        dout = torch.zeros_like(q)  # padding rows carry no loss
        for (rq, _, _), b in zip(requests, order):
            dout[b, :, :rq.shape[2]] = randn(*rq.shape[1:], dtype=dtype)
        batch = _grads(_ours(pos, window), q, k, v, dout)
        van_batch = _grads(_vanilla(pos, T, window), q, k, v, dout)
        for (rq, rk, rv), b in zip(requests, order):
            L = rq.shape[2]
            d_alone = dout[b:b + 1, :, :L]
            alone = _grads(_ours(arange_pos(1, L), window), rq, rk, rv, d_alone)
            for name, a, full in zip("qkv", alone, batch):
                assert_same_bits(a, full[b:b + 1, :, :L], f"d{name} of request of length {L}")
            van_alone = _grads(_vanilla(arange_pos(1, L), L, window), rq, rk, rv, d_alone)
            vanilla_differs |= any(not same_bits(a, full[b:b + 1, :, :L])
                                   for a, full in zip(van_alone, van_batch))
        if vanilla_differs:
            break
    assert vanilla_differs, "control: SDPA gradients alone and in the batch never differed"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_dk_dv_invariant_to_padding_length(dtype):
    Hkv, g, L, D = 2, 2, 45, 8
    vanilla_differs = False
    for _ in range(CONTROL_TRIES):
        rq, rk, rv = qkv(1, Hkv, g, L, L, D, dtype)
        d_alone = randn(*rq.shape, dtype=dtype)
        results, van_results = [], []
        for pad in (0, 3, 19, 83):  # queries and keys padded by `pad` (finite garbage)
            T = L + pad
            q, k, v = qkv(1, Hkv, g, T, T, D, dtype)
            q[:, :, :L], k[:, :, :L], v[:, :, :L] = rq, rk, rv
            dout = torch.zeros_like(q)
            dout[:, :, :L] = d_alone
            mask = torch.zeros(1, T, T, dtype=torch.bool)
            mask[:, :L, :L] = True  # padding rows see nothing, nothing sees padding slots
            grads = _grads(_ours(arange_pos(1, T), mask=mask), q, k, v, dout)
            results.append([x[:, :, :L] for x in grads])
            van = _grads(_vanilla(arange_pos(1, T), T, mask=mask), q, k, v, dout)
            van_results.append([x[:, :, :L] for x in van])
        for r in results[1:]:
            for a, b in zip(results[0], r):
                assert_same_bits(a, b, 'a')
        vanilla_differs = any(not same_bits(a, b) for r in van_results[1:]
                              for a, b in zip(van_results[0][1:], r[1:]))
        if vanilla_differs:
            break
    assert vanilla_differs, "control: SDPA dK/dV never changed with the padding length"


@pytest.mark.parametrize("window", [None, 5, 70], ids=["causal", "W5", "W70"])
def test_backward_chunking_and_skipping_give_the_same_bits(window):
    B, Hkv, g, S, T, D = 2, 2, 2, 37, 200, 8
    q, k, v = qkv(B, Hkv, g, S, T, D, torch.float32)
    pos = torch.randint(0, T - 60, (B, S))
    mask = torch.rand(B, S, T) < 0.8
    mask[:, :, KV_BLOCK:2 * KV_BLOCK] = False  # a block no query sees
    out, lse = attention_forward(q, k, v, pos, mask, True, window)
    dout, dlse = randn(*q.shape), randn(*lse.shape)
    ref = attention_backward(dout, dlse, q, k, v, out, lse, pos, mask, True, window)
    rows = KV_BLOCK * D * 4
    for kw in (dict(skip_blocks=False), dict(chunk_bytes=8 * rows), dict(chunk_bytes=5 * rows),
               dict(chunk_bytes=g * 64 * rows)):  # strided query chunks, 1 head per chunk
        got = attention_backward(dout, dlse, q, k, v, out, lse, pos, mask, True, window, **kw)
        assert all(same_bits(a, b) for a, b in zip(got, ref)), kw
    # control: dV = P^T dO summed over query chunks vs in one vanilla matmul differs; P over
    # every key (no mask or window), so each key's sum has all S terms and the two groupings
    # of those terms differ by construction (a narrow window leaves most sums one term long)
    p = torch.softmax(q @ k.repeat_interleave(g, 1).mT, -1)
    whole = p.mT @ dout
    chunked = sum(p[:, :, i:i + 8].mT @ dout[:, :, i:i + 8] for i in range(0, S, 8))
    assert_bits_differ(whole, chunked, 'whole')


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)],
                         ids=["fp32", "bf16"])
def test_backward_parity_with_fp64_reference(dtype, tol):
    B, Hkv, g, S, T, D = 2, 2, 3, 29, 140, 16
    q, k, v = qkv(B, Hkv, g, S, T, D, dtype)
    pos = torch.randint(0, T, (B, S))
    pos[:, 0] = -1  # a query that sees no key
    mask = torch.rand(B, S, T) < 0.7
    for window, m in ((None, None), (40, None), (None, mask), (90, mask)):
        vis = visibility(pos, T, window=window, mask=m)
        dout, dlse = randn(*q.shape, dtype=dtype), torch.randn(B, Hkv * g, S)
        seen = vis.any(-1)[:, None, :].expand_as(dlse)
        dlse = torch.where(seen, dlse, 0.0)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = attention(*leaves, pos, window=window, mask=m, return_lse=True)
        got = torch.autograd.grad((out, lse), leaves, (dout, dlse))
        ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = reference(*ref_leaves, vis)
        ref_lse = torch.where(seen, ref_lse, 0.0)
        ref = torch.autograd.grad((ref_out, ref_lse), ref_leaves, (dout.double(), dlse.double()))
        for name, a, r in zip("qkv", got, ref):
            assert a.dtype == dtype and not torch.isnan(a).any()
            assert rel_err(a, r) < tol, f"d{name} window={window} mask={m is not None}"
        blank = got[0][~seen]
        assert (blank == 0).all() and not torch.signbit(blank).any()
