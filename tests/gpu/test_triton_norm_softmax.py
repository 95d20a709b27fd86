"""Triton RMSNorm and softmax family: a row's bits ignore its batch, padding rows and vocab split.

Invariance is asserted bitwise; beside each check a negative control shows the plain
torch path (``torch.sum`` in another split, ``F.log_softmax`` alone vs in a batch, a plain
token sum) differs on the same inputs.  Parity with the ops' torch code (the CPU kernels'
functions run on CUDA tensors) is ``allclose``: fp32 1e-5, bf16 1e-2.  Skips without CUDA.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpinv.core.contract import DEFAULT_LEAVES, tree_combine
from tpinv.kernels import reference_norm, reference_softmax
from tpinv.testing import assert_bits_differ, assert_same_bits, same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda"
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}
ROWS = (1, 3, 64, 1000)


def rand(*shape, dtype=torch.float32, seed=0, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEV)


def tn():
    from tpinv.kernels import triton_norm
    return triton_norm


def ts():
    from tpinv.kernels import triton_softmax
    return triton_softmax


def assert_rows_invariant(fn, x):
    full = fn(x)
    for m in ROWS:
        if m <= x.shape[0]:
            for start in (0, x.shape[0] - m):
                assert_same_bits(fn(x[start:start + m]), full[start:start + m], f"M={m} at {start}")
    junk = rand(7, *x.shape[1:], dtype=x.dtype, seed=99)
    assert_same_bits(fn(torch.cat([x, junk]))[:x.shape[0]], full, "padding rows")
    return full


def test_registered_in_the_cuda_slots():
    from tpinv.ops.registry import OPS, cuda_kernel
    names = {"softmax": "triton_softmax.softmax_forward_cuda", "log_softmax": "triton_softmax.log_softmax_forward_cuda",
             "logsumexp": "triton_softmax.logsumexp_forward_cuda", "sum_exp_partial": "triton_softmax.sum_exp_partial_cuda",
             "rms_norm": "triton_norm.rms_norm_forward_cuda", "rms_norm_backward": "triton_norm.rms_norm_backward_cuda",
             "rms_norm_backward_heads": "triton_norm.rms_norm_backward_heads_cuda"}
    for name, kernel in names.items():
        d = OPS[f"tpinv::{name}"]
        assert d.cuda == kernel and cuda_kernel(d.op).__name__ == kernel, name


# ------------------------------------------------------------------ RMSNorm

@pytest.mark.parametrize("dtype", TOL)
@pytest.mark.parametrize("hidden", (1000, 4096, 1))
def test_rms_norm_rows_invariant_and_parity(dtype, hidden):
    x = rand(1000, hidden, dtype=dtype, seed=hidden)
    w = torch.rand(hidden, device=DEV) + 0.5    # fp32 weight: one rounding of n to x.dtype
    full = assert_rows_invariant(lambda t: tn().rms_norm_forward_cuda(t, w, 1e-6), x)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(full.float(), reference_norm.rms_norm_forward(x, w, 1e-6).float(),
                               rtol=rtol, atol=atol)


def test_rms_norm_split_sum_control():
    """A plain torch sum of squares changes with the reduction's split (and so with a TP cut)."""
    x = rand(64, 8192, seed=3)
    sq = x * x
    whole = sq.sum(-1)
    halves = sq[:, :4096].sum(-1) + sq[:, 4096:].sum(-1)
    quarters = sum(c.sum(-1) for c in sq.chunk(4, -1))
    assert not same_bits(whole, halves) or not same_bits(whole, quarters)


def test_rms_norm_backward_rows_and_dweight_padding():
    hidden = 1000
    x = rand(300, hidden, dtype=torch.bfloat16, seed=4)
    g = rand(300, hidden, dtype=torch.bfloat16, seed=5)
    w = (torch.rand(hidden, device=DEV) + 0.5).to(torch.bfloat16)
    dx, dw = tn().rms_norm_backward_cuda(g, x, w, 1e-6)
    for m in (1, 3, 64):
        assert_same_bits(tn().rms_norm_backward_cuda(g[:m], x[:m], w, 1e-6)[0], dx[:m],
                         'tn().rms_norm_backward_cuda(g[:m], x[:m], w, 1e...')
    for pad in (1, 212, 2000):   # zero-grad padding tokens, to and past the next power of two
        xp = torch.cat([x, rand(pad, hidden, dtype=x.dtype, seed=pad)])
        gp = torch.cat([g, torch.zeros(pad, hidden, dtype=g.dtype, device=DEV)])
        dxp, dwp = tn().rms_norm_backward_cuda(gp, xp, w, 1e-6)
        assert_same_bits(dwp, dw, f"pad={pad}")
        assert_same_bits(dxp[:300], dx, f"pad={pad}")
    rdx, rdw = reference_norm.rms_norm_backward(g.float(), x.float(), w.float(), 1e-6)
    torch.testing.assert_close(dx.float(), rdx, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.float(), rdw, rtol=2e-2, atol=2e-1)


def test_rms_norm_backward_heads_is_each_head_alone_and_control():
    """Qwen3 q/k norm: one launch for every head; each head's dweight row has the bits of a
    call on that head alone (and one token sum over all rows does not, with 6 heads)."""
    x = rand(2, 300, 6, 128, dtype=torch.bfloat16, seed=6)
    g = rand(2, 300, 6, 128, dtype=torch.bfloat16, seed=7)
    w = (torch.rand(128, device=DEV) + 0.5).to(torch.bfloat16)
    dx, per_head = tn().rms_norm_backward_heads_cuda(g, x, w, 1e-6)
    for h in range(6):
        dx_h, dw_h = tn().rms_norm_backward_cuda(g[..., h, :].contiguous(), x[..., h, :].contiguous(), w, 1e-6)
        assert_same_bits(dx[..., h, :], dx_h, str(h))
        assert_same_bits(per_head[h], dw_h, str(h))
    _, all_rows = tn().rms_norm_backward_cuda(g.float() * 1e3, x.float(), w.float(), 1e-6)
    _, heads32 = tn().rms_norm_backward_heads_cuda(g.float() * 1e3, x.float(), w.float(), 1e-6)
    from tpinv.kernels.reference_tree import halving_sum
    assert_bits_differ(halving_sum(heads32.t()), all_rows, 'halving_sum(heads32.t())')


@pytest.mark.parametrize("hidden,tokens,heads", [(128, 4096, 16), (128, 777, 8), (128, 5, 2), (1024, 4096, 1),
                                                 (4096, 300, 1), (20000, 9, 1)])
def test_rms_norm_dweight_is_the_halving_sum_of_the_forward_n(hidden, tokens, heads):
    """fp32, unit weight: the forward's output is n, and dweight is exactly the contiguous halving
    over the tokens of g * n (the first levels inside the backward's tiles, the rest over their
    partials) -- the backward's n is the forward's.  Control: adjacent token pairs differ."""
    from tpinv.kernels.reference_tree import halving_sum
    x, g = rand(tokens, heads, hidden, seed=hidden), rand(tokens, heads, hidden, seed=tokens)
    one = torch.ones(hidden, device=DEV)
    n = tn().rms_norm_forward_cuda(x, one, 1e-6)
    _, per_head = tn().rms_norm_backward_heads_cuda(g, x, one, 1e-6)
    contrib = (g * n).permute(1, 2, 0)
    assert_same_bits(per_head, halving_sum(contrib), f"H={hidden} T={tokens}")
    if tokens >= 4:
        adjacent = F.pad(contrib, (0, (1 << (tokens - 1).bit_length()) - tokens))
        while adjacent.shape[-1] > 1:
            adjacent = adjacent[..., 0::2] + adjacent[..., 1::2]
        assert_bits_differ(per_head, adjacent[..., 0], "control: adjacent token pairs")


def test_rms_norm_backward_fp32_parity_with_torch_code():
    x, g = rand(37, 777, seed=6), rand(37, 777, seed=7)
    w = torch.rand(777, device=DEV) + 0.5
    dx, dw = tn().rms_norm_backward_cuda(g, x, w, 1e-6)
    rdx, rdw = reference_norm.rms_norm_backward(g, x, w, 1e-6)
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-4)


def test_plain_token_sum_split_control():
    contrib = rand(4096, 512, seed=8)
    whole = contrib.sum(0)
    assert any(not same_bits(whole, sum(c.sum(0) for c in contrib.chunk(k, 0))) for k in (2, 4, 8))


# ------------------------------------------------------------------ softmax family

@pytest.mark.parametrize("dtype", TOL)
@pytest.mark.parametrize("name", ("log_softmax", "softmax", "logsumexp"))
def test_softmax_rows_invariant_and_parity(dtype, name):
    x = rand(1000, 8 * 125, dtype=dtype, seed=len(name))
    fn = getattr(ts(), f"{name}_forward_cuda")
    full = assert_rows_invariant(lambda t: fn(t, DEFAULT_LEAVES), x)
    ref = getattr(reference_softmax, f"{name}_forward")(x, DEFAULT_LEAVES)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(full.float(), ref.float(), rtol=rtol, atol=atol)


def test_sum_exp_partial_rows_invariant():
    x = rand(1000, 8 * 300 + 8, seed=11)
    max_all = x.amax(-1)
    full = ts().sum_exp_partial_cuda(x, max_all, DEFAULT_LEAVES)
    for m in ROWS:
        assert_same_bits(ts().sum_exp_partial_cuda(x[-m:], max_all[-m:], DEFAULT_LEAVES), full[-m:],
                         'ts().sum_exp_partial_cuda(x[-m:], max_all[-m:],...')


@pytest.mark.parametrize("dtype", TOL)
@pytest.mark.parametrize("width", (151936, 8 * 37))
def test_vocab_split_equals_unsplit(dtype, width):
    x = rand(6, width, dtype=dtype, seed=width)
    max_ = x.float().amax(-1)
    whole = ts().sum_exp_partial_cuda(x, max_, DEFAULT_LEAVES)
    for ranks in (1, 2, 4, 8):
        parts = torch.stack([ts().sum_exp_partial_cuda(s, max_, DEFAULT_LEAVES // ranks)
                             for s in x.chunk(ranks, -1)], -1)
        assert_same_bits(tree_combine(parts), whole, f"C={ranks}")
    log_sm = ts().log_softmax_forward_cuda(x, DEFAULT_LEAVES)
    composed = torch.cat([reference_softmax.log_softmax_from_parts(s, max_, whole).to(dtype)
                          for s in x.chunk(2, -1)], -1)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(log_sm.float(), composed.float(), rtol=rtol, atol=atol)
    ref = reference_softmax.sum_exp_partial(x, max_, DEFAULT_LEAVES)
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("dtype", TOL)
@pytest.mark.parametrize("width", (151936, 8 * 37, 8 * 4099, 8))
def test_fused_equals_vocab_split_composition(dtype, width):
    """One launch == amax, per-slice partials tree-combined in rank order, per-slice output."""
    x = rand(37, width, dtype=dtype, seed=width + 1, scale=4.0)
    m, s = ts().max_and_sum_exp_cuda(x, DEFAULT_LEAVES)
    max_ = x.float().amax(-1)
    assert_same_bits(m, max_, 'm')
    fused = {"log_softmax": ts().log_softmax_forward_cuda(x, DEFAULT_LEAVES),
             "softmax": ts().softmax_forward_cuda(x, DEFAULT_LEAVES)}
    for ranks in (1, 2, 4, 8):
        slices = x.chunk(ranks, -1)
        total = tree_combine(torch.stack([ts().sum_exp_partial_cuda(sl, max_, DEFAULT_LEAVES // ranks)
                                          for sl in slices], -1))
        assert_same_bits(total, s, f"sum C={ranks}")
        for name, fn in (("log_softmax", ts().log_softmax_from_parts_cuda),
                         ("softmax", ts().softmax_from_parts_cuda)):
            split = torch.cat([fn(sl, max_, total) for sl in slices], -1)
            assert_same_bits(split, fused[name], f"{name} C={ranks}")
    lse = ts().logsumexp_forward_cuda(x, DEFAULT_LEAVES)
    assert_same_bits(lse, reference_softmax.logsumexp_from_parts(max_, s).to(dtype), 'lse')


@pytest.mark.parametrize("dtype", TOL)
def test_fused_rows_invariant_at_vocab_width(dtype):
    """Rows alone, in a batch larger than the persistent grid, and beside junk rows."""
    x = rand(300, 151936 // 8 * 2, dtype=dtype, seed=21)
    for name in ("log_softmax", "softmax", "logsumexp"):
        fn = getattr(ts(), f"{name}_forward_cuda")
        assert_rows_invariant(lambda t: fn(t, DEFAULT_LEAVES), x)
    big = rand(1100, 151936, dtype=dtype, seed=22)
    full = ts().log_softmax_forward_cuda(big, DEFAULT_LEAVES)
    for lo, hi in ((0, 1), (517, 518), (1099, 1100), (3, 300)):
        assert_same_bits(ts().log_softmax_forward_cuda(big[lo:hi], DEFAULT_LEAVES), full[lo:hi],
                         'ts().log_softmax_forward_cuda(big[lo:hi], DEFAU...')


def test_fused_config_knobs_do_not_move_bits():
    """Row chunk, warps, grid size, leaf grouping, eviction hints and pipeline stages are speed
    choices only."""
    x = rand(50, 151936, dtype=torch.bfloat16, seed=23)
    want = ts()._fused(x, DEFAULT_LEAVES, ts()._MODE_LOG)
    for config in ((4096, 4, 1, 1, False, 1), (32768, 16, 3, 8, True, 2), (8192, 8, 1, 2, True, 3),
                   (16384, 4, 6, 1, True, 2), (8192, 8, 0.5, 2, False, 1)):
        got = ts()._fused(x, DEFAULT_LEAVES, ts()._MODE_LOG, config)
        for a, b in zip(got, want):
            assert_same_bits(a, b, str(config))


def test_plain_vocab_split_and_batch_controls():
    x = rand(6, 151936, seed=12)
    max_ = x.amax(-1, keepdim=True)
    e = torch.exp(x - max_)
    whole = e.sum(-1)
    assert any(not same_bits(whole, sum(c.sum(-1) for c in e.chunk(k, -1))) for k in (2, 4, 8))
    differs = []
    for rows, width in ((4096, 151936 // 8), (1024, 151936)):
        big = rand(rows, width, seed=rows)
        batch = F.log_softmax(big, -1)
        differs.append(not same_bits(F.log_softmax(big[:1], -1), batch[:1]))
        differs.append(not same_bits(batch, ts().log_softmax_forward_cuda(big, DEFAULT_LEAVES)))
    assert any(differs)


def test_infinite_rows_and_errors():
    x = rand(3, 64)
    x[1] = float("-inf")
    lse = ts().logsumexp_forward_cuda(x, DEFAULT_LEAVES)
    assert torch.isneginf(lse[1]) and torch.isfinite(lse[[0, 2]]).all()
    x[2, 7] = float("nan")
    m, _ = ts().max_and_sum_exp_cuda(x, DEFAULT_LEAVES)
    assert torch.isnan(m[2])
    assert_same_bits(m[[0, 1]], x.amax(-1)[[0, 1]], 'm[[0, 1]]')
    with pytest.raises(Exception, match="divisible|multiple"):
        ts().log_softmax_forward_cuda(rand(2, 63), DEFAULT_LEAVES)
    with pytest.raises(Exception, match=r"\(64,\)"):
        tn().rms_norm_forward_cuda(rand(2, 64), torch.ones(63, device=DEV), 1e-6)
