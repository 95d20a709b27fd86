"""tpinv.ops.softmax: softmax / log_softmax / logsumexp and the vocab-split pieces.

Bitwise invariance to batch composition, padding, threads, strides and to splitting the
last dim over C = 1, 2, 4, 8 ranks; each invariance test has a negative control beside it
(the plain torch.sum / torch.logsumexp path, which gives different bits for the same inputs).
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tpinv.testing import assert_bits_differ, assert_same_bits, num_threads, same_bits
from tpinv.core.contract import DEFAULT_LEAVES, InvarianceError, tree_combine
from tpinv.kernels.reference_tree import leaf_tree_sum
from tpinv.ops.registry import cuda_kernel, has_cuda_kernel
from tpinv.ops.softmax import (log_softmax, log_softmax_backward_op, log_softmax_from_parts, log_softmax_op,
                               logsumexp, logsumexp_backward_op, logsumexp_from_parts, logsumexp_op, softmax,
                               softmax_backward_op, softmax_from_parts, softmax_op, sum_exp_partial,
                               sum_exp_partial_op)
from tpinv.testing import record_ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = {"softmax": softmax, "log_softmax": log_softmax, "logsumexp": logsumexp}
TORCH_OPS = {"softmax": lambda x: F.softmax(x, -1), "log_softmax": lambda x: F.log_softmax(x, -1),
             "logsumexp": lambda x: torch.logsumexp(x, -1)}
# Parity with PyTorch as (rtol, atol): fp32 differs only in summation order, 16-bit results
# may differ by one rounding of the output.
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-3, 1e-3)}


def randn(*shape, dtype=torch.float32, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def fwd_bwd(op, x, grad, **kw):
    x = x.detach().clone().requires_grad_(True)
    y = op(x, **kw)
    y.backward(grad)
    return y.detach(), x.grad


def grad_for(name, x, seed=1):
    shape = x.shape[:-1] if name == "logsumexp" else x.shape
    return randn(*shape, dtype=x.dtype, seed=seed, scale=1.0)


def sum_softmax(x):
    """The plain reference: exp(x - max) / torch.sum."""
    x = x.float()
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


# --- row alone == row in batch ---------------------------------------------------------

@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("vocab", [40, 72])
def test_row_alone_equals_row_in_batch(name, dtype, batch, vocab):
    x = randn(batch, vocab, dtype=dtype, seed=batch + vocab)
    grad = grad_for(name, x)
    y, dx = fwd_bwd(OPS[name], x, grad)
    for i in range(batch):
        y1, dx1 = fwd_bwd(OPS[name], x[i:i + 1], grad[i:i + 1])
        assert_same_bits(y[i:i + 1], y1, 'y[i:i + 1]')
        assert_same_bits(dx[i:i + 1], dx1, 'dx[i:i + 1]')


def test_row_alone_vanilla_differs():
    x = randn(3, 40000, seed=2)
    with num_threads(2):
        batched = sum_softmax(x)
        alone = torch.cat([sum_softmax(x[i:i + 1]) for i in range(3)])
        ours = softmax(x)
        ours_alone = torch.cat([softmax(x[i:i + 1]) for i in range(3)])
    assert_bits_differ(batched, alone, 'batched')
    assert_same_bits(ours, ours_alone, 'ours')


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 9), leaf_len=st.integers(1, 13), seed=st.integers(0, 2**16),
       name=st.sampled_from(sorted(OPS)))
def test_row_alone_property(batch, leaf_len, seed, name):
    x = randn(batch, 8 * leaf_len, seed=seed)
    grad = grad_for(name, x, seed + 1)
    row = seed % batch
    y, dx = fwd_bwd(OPS[name], x, grad)
    y1, dx1 = fwd_bwd(OPS[name], x[row:row + 1], grad[row:row + 1])
    assert_same_bits(y[row:row + 1], y1, 'y[row:row + 1]')
    assert_same_bits(dx[row:row + 1], dx1, 'dx[row:row + 1]')


# --- vocab split over C ranks -------------------------------------------------------------

def split_pieces(x, ranks, leaves=DEFAULT_LEAVES):
    """What C ranks compute: exact global max, per-rank sub-tree partials, the tree on top."""
    slices = x.chunk(ranks, dim=-1)
    max_ = torch.stack([s.float().amax(-1) for s in slices], -1).amax(-1)
    partials = [sum_exp_partial(s, max_, leaves // ranks) for s in slices]
    return slices, max_, tree_combine(torch.stack(partials, -1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("vocab", [40, 72, 1000])
def test_vocab_split_equals_unsplit(dtype, ranks, vocab):
    x = randn(6, vocab, dtype=dtype, seed=vocab + ranks)
    slices, max_, total = split_pieces(x, ranks)
    assert_same_bits(logsumexp_from_parts(max_, total).to(dtype), logsumexp(x),
                     'logsumexp_from_parts(max_, total).to(dtype)')
    log_sm = torch.cat([log_softmax_from_parts(s, max_, total).to(dtype) for s in slices], -1)
    assert_same_bits(log_sm, log_softmax(x), 'log_sm')
    sm = torch.cat([softmax_from_parts(s, max_, total).to(dtype) for s in slices], -1)
    assert_same_bits(sm, softmax(x), 'sm')
    # Backward of logsumexp on the split: g * softmax_from_parts, per slice.
    g = grad_for("logsumexp", x)
    _, dx = fwd_bwd(logsumexp, x, g)
    dx_split = torch.cat([(g.float().unsqueeze(-1) * softmax_from_parts(s, max_, total)).to(dtype)
                          for s in slices], -1)
    assert_same_bits(dx_split, dx, 'dx_split')


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("vocab", [40, 72, 1000])
def test_vocab_split_vanilla_differs(ranks, vocab):
    """torch.logsumexp per slice, combined left to right, differs from the unsplit row."""
    x = randn(16, vocab, seed=vocab + ranks)
    parts = [torch.logsumexp(s, -1) for s in x.chunk(ranks, -1)]
    combined = parts[0]
    for part in parts[1:]:
        combined = torch.logaddexp(combined, part)
    assert_bits_differ(combined, torch.logsumexp(x, -1), 'combined')
    _, max_, total = split_pieces(x, ranks)
    assert_same_bits(logsumexp_from_parts(max_, total), logsumexp(x), 'logsumexp_from_parts(max_, total)')


@settings(max_examples=12, deadline=None)
@given(leaf_len=st.integers(1, 40), ranks=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**16))
def test_vocab_split_property(leaf_len, ranks, seed):
    x = randn(3, 8 * leaf_len, seed=seed)
    slices, max_, total = split_pieces(x, ranks)
    assert_same_bits(total, leaf_tree_sum(torch.exp(x - max_.unsqueeze(-1)), DEFAULT_LEAVES), 'total')
    assert_same_bits(torch.cat([log_softmax_from_parts(s, max_, total) for s in slices], -1), log_softmax(x),
                     'torch.cat([log_softmax_from_parts(s, max_, tota...')


def test_sum_exp_partial_gradient():
    x = randn(4, 40, seed=9).requires_grad_(True)
    max_ = x.detach().amax(-1)
    sum_exp_partial(x, max_, 8).sum().backward()
    assert_same_bits(x.grad, torch.exp(x.detach() - max_.unsqueeze(-1)), 'x.grad')


# --- padding -------------------------------------------------------------------------

@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length,pad", [(60, 7), (33, 31), (5, 3)])
def test_minus_inf_padding_with_one_leaf(name, dtype, length, pad):
    """leaves=1 (a dim no parallelism splits, e.g. attention keys): -inf padding is exact."""
    x = randn(6, length, dtype=dtype, seed=length)
    padded = F.pad(x, (0, pad), value=float("-inf"))
    y, y_pad = OPS[name](x, leaves=1), OPS[name](padded, leaves=1)
    assert_same_bits(y, y_pad if name == "logsumexp" else y_pad[:, :length], 'y')
    g = grad_for(name, x)
    g_pad = g if name == "logsumexp" else F.pad(g, (0, pad))
    _, dx = fwd_bwd(OPS[name], x, g, leaves=1)
    _, dx_pad = fwd_bwd(OPS[name], padded, g_pad, leaves=1)
    assert_same_bits(dx, dx_pad[:, :length], 'dx')


def test_minus_inf_padding_vanilla_differs():
    x = randn(6, 60, seed=60)
    padded = F.pad(x, (0, 7), value=float("-inf"))
    assert_bits_differ(sum_softmax(x), sum_softmax(padded)[:, :60], 'sum_softmax(x)')
    assert_same_bits(softmax(x, leaves=1), softmax(padded, leaves=1)[:, :60], 'softmax(x, leaves=1)')


@pytest.mark.parametrize("name", OPS)
def test_padding_rows_do_not_change_results(name):
    x = randn(2, 9, 72, seed=4)
    padded = torch.cat([x, randn(2, 5, 72, seed=5)], dim=1)
    g_padded = grad_for(name, padded)
    y, dx = fwd_bwd(OPS[name], x, g_padded[:, :9])
    y_pad, dx_pad = fwd_bwd(OPS[name], padded, g_padded)
    assert_same_bits(y, y_pad[:, :9], 'y')
    assert_same_bits(dx, dx_pad[:, :9], 'dx')


def test_padding_rows_vanilla_differs():
    """A one-token sequence padded to six rows: torch.sum splits the lone row over threads."""
    x = randn(8, 1, 40000, seed=3)
    pad = randn(1, 3, 40000, seed=5)
    with num_threads(2):
        alone = [sum_softmax(x[i:i + 1]) for i in range(8)]
        padded = [sum_softmax(torch.cat([x[i:i + 1], pad], 1))[:, :1] for i in range(8)]
        assert any(not same_bits(a, b) for a, b in zip(alone, padded))
        assert_same_bits(softmax(x[:1]), softmax(torch.cat([x[:1], pad], 1))[:, :1], 'softmax(x[:1])')


# --- threads --------------------------------------------------------------------------

def per_row_thread_results(fn, x):
    """Each row alone (one output, so the reduction itself is split over threads)."""
    results = []
    for i in range(x.shape[0]):
        with num_threads(1):
            one = fn(x[i:i + 1])
        with num_threads(2):
            two = fn(x[i:i + 1])
        results.append((one, two))
    return results


@pytest.mark.parametrize("name", OPS)
def test_one_thread_equals_two_threads(name):
    x = randn(2, 40000, seed=70)
    g = grad_for(name, x)
    for i in range(x.shape[0]):
        with num_threads(1):
            one = fwd_bwd(OPS[name], x[i:i + 1], g[i:i + 1])
        with num_threads(2):
            two = fwd_bwd(OPS[name], x[i:i + 1], g[i:i + 1])
        assert_same_bits(one[0], two[0], 'one[0]')
        assert_same_bits(one[1], two[1], 'one[1]')


def test_threads_vanilla_differs():
    x = randn(8, 40000, seed=70)
    assert any(not same_bits(a, b) for a, b in per_row_thread_results(sum_softmax, x))


# --- strides ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_equals_contiguous(name, dtype):
    x = randn(5, 72, dtype=dtype, seed=12)
    strided = x.t().contiguous().t()
    assert not strided.is_contiguous()
    g = grad_for(name, x)
    a, b = fwd_bwd(OPS[name], x, g), fwd_bwd(OPS[name], strided, g)
    assert_same_bits(a[0], b[0], 'a[0]')
    assert_same_bits(a[1], b[1], 'a[1]')


def test_strided_vanilla_differs():
    x = randn(5, 72, seed=12)
    assert_bits_differ(sum_softmax(x), sum_softmax(x.t().contiguous().t()), 'sum_softmax(x)')
    assert_same_bits(softmax(x), softmax(x.t().contiguous().t()), 'softmax(x)')


# --- parity with PyTorch ------------------------------------------------------------------

@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_parity_with_torch(name, dtype):
    x = randn(7, 1000, dtype=dtype, seed=21)
    g = grad_for(name, x)
    ours, ref = fwd_bwd(OPS[name], x, g), fwd_bwd(TORCH_OPS[name], x, g)
    assert ours[0].dtype == ref[0].dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(ours[0], ref[0], rtol=rtol, atol=atol)
    # Backward against PyTorch's fp32 gradient (its 16-bit backward reuses the rounded output).
    _, ref_dx = fwd_bwd(TORCH_OPS[name], x.float(), g.float())
    torch.testing.assert_close(ours[1], ref_dx.to(dtype), rtol=rtol, atol=atol)


def test_default_leaves_and_infinite_rows():
    x = randn(3, 40, seed=1)
    assert_same_bits(softmax(x), softmax(x, leaves=DEFAULT_LEAVES), 'softmax(x)')
    x[1] = float("-inf")
    assert_same_bits(logsumexp(x)[1], torch.tensor(float("-inf")), 'logsumexp(x)[1]')
    torch.testing.assert_close(logsumexp(x), torch.logsumexp(x, -1))


# --- the op ran, registration, errors ------------------------------------------------------

@pytest.mark.parametrize("name", OPS)
def test_custom_ops_run_and_pass_opcheck(name):
    x = randn(2, 40)
    with record_ops() as log:
        fwd_bwd(OPS[name], x, grad_for(name, x))
    assert f"tpinv::{name}" in log and f"tpinv::{name}_backward" in log
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(getattr(torch.ops.tpinv, name).default, (x.requires_grad_(), 8), test_utils=checks)
    if name == "logsumexp":
        torch.library.opcheck(torch.ops.tpinv.sum_exp_partial.default, (x, x.detach().amax(-1), 4),
                              test_utils=checks)


@pytest.mark.parametrize("name", OPS)
def test_bad_inputs(name):
    op = OPS[name]
    with pytest.raises(InvarianceError, match="41 is not divisible by leaves=8"):
        op(randn(2, 41))
    with pytest.raises(InvarianceError, match="power of two"):
        op(randn(2, 42), leaves=3)
    with pytest.raises(InvarianceError, match="dtype"):
        op(randn(2, 40).double())
    with pytest.raises(InvarianceError, match="dtype"):
        op(torch.ones(2, 40, dtype=torch.int64))
    with pytest.raises(InvarianceError, match=r"\[\.\.\., V\]"):
        op(torch.tensor(1.0), leaves=1)


def test_bad_partial_inputs():
    x = randn(3, 40)
    with pytest.raises(InvarianceError, match=r"shape \(3,\)"):
        sum_exp_partial(x, x.amax(-1, keepdim=True), 8)
    with pytest.raises(TypeError, match="fp32"):
        sum_exp_partial(x, x.amax(-1).bfloat16(), 8)
    with pytest.raises(InvarianceError, match="divisible"):
        sum_exp_partial(x, x.amax(-1), 16)
    with pytest.raises(InvarianceError, match="same shape"):
        logsumexp_from_parts(x.amax(-1), torch.ones(4))
