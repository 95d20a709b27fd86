"""The Triton softmax kernels under Triton's interpreter (CPU tensors), bitwise.

Checked: the fused one-launch kernel gives the bits of the split composition -- exact
``amax``, :func:`sum_exp_partial_cuda` on ``C`` vocabulary slices combined by
``tree_combine`` in rank order, the from-parts output kernel on each slice -- for
``C = 1, 2, 4, 8``, ``leaves = 1, 2, 4, 8``, fp32 and fp16, with one and with many
``BLOCK`` steps per leaf; a row's bits alone == in a batch == beside junk rows, for several
persistent-grid sizes and leaf groupings; the lane fold is contiguous halving and the leaf
combine the adjacent-pair tree; parity with :mod:`tpinv.kernels.reference_softmax`; rows the
by-leaves kernel takes on CUDA stay on the row kernel under the interpreter.

The checks run in one child process with the interpreter on (:mod:`triton_interp`).  Negative
controls (plain torch, in this process): a vocabulary-parallel sum in the usual order and a
lane fold in another order both change the bits.  The batch-size control of the plain
path (``F.log_softmax``) needs a GPU: ``tests/gpu/test_triton_norm_softmax.py``.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from triton_interp import interpreted_test, main
from tpinv.testing import assert_bits_differ, assert_same_bits, same_bits

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def test_plain_vocab_split_sum_control():
    """The usual vocab-parallel sum (each rank sums its slice, partials added in turn) moves bits."""
    gen = torch.Generator().manual_seed(1)
    e = torch.exp(3 * torch.randn(16, 8 * 1024, generator=gen))
    whole = e.sum(-1)
    differs = []
    for ranks in (2, 4, 8):
        parts = [c.sum(-1) for c in e.chunk(ranks, -1)]
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        differs.append(not same_bits(total, whole))
    assert any(differs)


def test_lane_fold_order_control():
    """Folding the same lanes in another order (left to right) gives other bits: the order is fixed."""
    gen = torch.Generator().manual_seed(2)
    lanes = torch.exp(4 * torch.randn(64, 256, generator=gen))
    halving = lanes
    while halving.shape[-1] > 1:
        half = halving.shape[-1] // 2
        halving = halving[:, :half] + halving[:, half:]
    serial = lanes[:, 0].clone()
    for i in range(1, lanes.shape[-1]):
        serial = serial + lanes[:, i]
    assert_bits_differ(halving.squeeze(-1), serial, 'halving.squeeze(-1)')


# ---------------------------------------------------------------- the child process

def _rand(rows, width, dtype, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, width, generator=gen)).to(dtype)


def _check_fused_equals_split_composition(ts):
    from tpinv.core.contract import tree_combine
    from tpinv.kernels.reference_softmax import logsumexp_from_parts
    for max_block in (ts._MAX_LEAF_BLOCK, 16):        # one BLOCK step per leaf, then many
        ts._MAX_LEAF_BLOCK = max_block
        for dtype in (torch.float32, torch.float16):
            for leaves in (1, 2, 4, 8):
                x = _rand(5, leaves * 37, dtype, seed=leaves)
                m, s = ts.max_and_sum_exp_cuda(x, leaves)
                m_ref = x.float().amax(-1)
                assert_same_bits(m, m_ref, str((dtype, leaves, "max")))
                outs = {"log_softmax": ts.log_softmax_forward_cuda(x, leaves),
                        "softmax": ts.softmax_forward_cuda(x, leaves)}
                for ranks in (c for c in (1, 2, 4, 8) if c <= leaves):
                    slices = x.chunk(ranks, -1)
                    parts = [ts.sum_exp_partial_cuda(sl, m_ref, leaves // ranks) for sl in slices]
                    s_ref = tree_combine(torch.stack(parts, -1))
                    where = (max_block, dtype, leaves, ranks)
                    assert_same_bits(s, s_ref, str(where))
                    for name, fn in (("log_softmax", ts.log_softmax_from_parts_cuda),
                                     ("softmax", ts.softmax_from_parts_cuda)):
                        split = torch.cat([fn(sl, m_ref, s_ref) for sl in slices], -1)
                        assert_same_bits(outs[name], split, str((name, *where)))
                lse = ts.logsumexp_forward_cuda(x, leaves)
                assert_same_bits(lse, logsumexp_from_parts(m_ref, s).to(dtype), str((dtype, leaves)))
    ts._MAX_LEAF_BLOCK = 4096


def _check_rows_alone_equal_batch(ts):
    ts._MAX_LEAF_BLOCK = 16
    try:
        for dtype in (torch.float32, torch.float16):
            x = _rand(9, 8 * 21, dtype, seed=3)
            junk = _rand(4, 8 * 21, dtype, seed=4, scale=30.0)
            full = ts._fused(x, 8, ts._MODE_LOG)
            for programs in (1, 2, 5):
                ts._PROGRAMS_OFF_CUDA = programs
                for lo, hi in ((0, 1), (4, 5), (8, 9), (2, 7), (0, 9)):
                    part = ts._fused(x[lo:hi], 8, ts._MODE_LOG)
                    for got, want in zip(part, full):
                        assert_same_bits(got, want[lo:hi], str((dtype, programs, lo, hi)))
                padded = ts._fused(torch.cat([junk[:2], x, junk[2:]]), 8, ts._MODE_LOG)
                for got, want in zip(padded, full):
                    assert_same_bits(got[2:11], want, str((dtype, programs, "padding rows")))
            ts._PROGRAMS_OFF_CUDA = 3
            row_block, warps, per_sm, _, evict, stages = ts._FUSED_CONFIG[dtype]
            for group in (1, 2, 4, 8):                 # leaves summed side by side
                for mode in (ts._MODE_LOG, ts._MODE_SOFTMAX):
                    got = ts._fused(x, 8, mode, (64, warps, per_sm, group, evict, stages))
                    want = full if mode == ts._MODE_LOG else ts._fused(x, 8, mode)
                    for a, b in zip(got, want):
                        assert_same_bits(a, b, str((dtype, group, mode)))
    finally:
        ts._MAX_LEAF_BLOCK, ts._PROGRAMS_OFF_CUDA = 4096, 3


def _check_fold_and_tree_order(ts):
    import triton
    import triton.language as tl

    from tpinv.core.contract import tree_combine

    globals().update(_fold_lanes=ts._fold_lanes, _pair_tree=ts._pair_tree)   # jit resolves globals

    @triton.jit
    def fold_kernel(v_ptr, out_ptr, GROUP: tl.constexpr, LOG2_GROUP: tl.constexpr,
                    BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
        idx = tl.arange(0, GROUP)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        folded = _fold_lanes(tl.load(v_ptr + idx), GROUP, BLOCK, LOG2_BLOCK)
        tl.store(out_ptr + tl.arange(0, GROUP), folded)
        tl.store(out_ptr + GROUP, _pair_tree(folded, GROUP, LOG2_GROUP))

    gen = torch.Generator().manual_seed(5)
    v = torch.exp(4 * torch.randn(8, 64, generator=gen))
    out = torch.empty(9)
    fold_kernel[(1,)](v, out, GROUP=8, LOG2_GROUP=3, BLOCK=64, LOG2_BLOCK=6)
    halving = v
    while halving.shape[-1] > 1:
        half = halving.shape[-1] // 2
        halving = halving[:, :half] + halving[:, half:]
    assert_same_bits(out[:8], halving.squeeze(-1), "lane fold is not contiguous halving")
    assert_same_bits(out[8], tree_combine(halving.squeeze(-1)), "leaf combine is not the pair tree")


def _check_parity_with_cpu_kernels(ts):
    from tpinv.kernels import reference_softmax
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x = _rand(4, 8 * 45, dtype, seed=6)
        for name in ("log_softmax", "softmax", "logsumexp"):
            got = getattr(ts, f"{name}_forward_cuda")(x, 8)
            want = getattr(reference_softmax, f"{name}_forward")(x, 8)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        max_ = x.float().amax(-1)
        torch.testing.assert_close(ts.sum_exp_partial_cuda(x, max_, 8),
                                   reference_softmax.sum_exp_partial(x, max_, 8), rtol=1e-5, atol=0.0)


def _check_infinite_and_nan_rows(ts):
    from tpinv.kernels import reference_softmax
    x = _rand(4, 64, torch.float32, seed=7)
    x[0] = float("-inf")
    x[1, 5] = float("inf")
    x[2, 9] = float("nan")
    m, _ = ts.max_and_sum_exp_cuda(x, 8)
    assert torch.isnan(m[2]), "max as torch.amax"
    assert_same_bits(m[[0, 1, 3]], x.amax(-1)[[0, 1, 3]], "max as torch.amax")
    for name in ("log_softmax", "softmax", "logsumexp"):
        got = getattr(ts, f"{name}_forward_cuda")(x, 8)
        want = getattr(reference_softmax, f"{name}_forward")(x, 8)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isneginf(ts.logsumexp_forward_cuda(x, 8)[0])


def _check_from_parts_errors(ts):
    x = _rand(3, 16, torch.float32, seed=8)
    m, s = ts.max_and_sum_exp_cuda(x, 8)
    for bad, err in (((x, m.half(), s), TypeError), ((x, m, s[:2]), ValueError)):
        try:
            ts.log_softmax_from_parts_cuda(*bad)
        except err:
            continue
        raise AssertionError(f"expected {err.__name__} for {[tuple(t.shape) for t in bad]}")


def _check_interpreter_runs_the_row_kernel(ts):
    """Rows long enough for the by-leaves kernel on CUDA stay on the row kernel here: the by-leaves
    programs wait for each other, which the interpreter (programs one after another) cannot run."""
    from tpinv.kernels import triton_softmax_leaves as bl
    assert bl.BY_LEAVES[0]
    x = _rand(2, 8 * bl.MIN_LEAF_LEN, torch.float32, seed=5)

    def refuse(*args, **kwargs):
        raise AssertionError("the by-leaves kernel was called under the interpreter")

    real, bl.softmax_rows_by_leaves = bl.softmax_rows_by_leaves, refuse
    try:
        for mode in (ts._MODE_STATS, ts._MODE_LOG, ts._MODE_SOFTMAX):
            assert not bl.runs_by_leaves(x, 8, mode)
            got = ts._fused(x, 8, mode)
            want = ts._fused(x, 8, mode, ts._FUSED_CONFIG[x.dtype])
            for a, b in zip(got, want):
                if b is not None:
                    assert_same_bits(a, b, str(mode))
    finally:
        bl.softmax_rows_by_leaves = real


def _with_kernels(check):
    def run():
        torch.set_num_threads(1)
        from tpinv.kernels import triton_softmax as ts
        check(ts)
    return run


CHECKS = {name[1:]: _with_kernels(fn) for name, fn in dict(globals()).items() if name.startswith("_check_")}
test_interpreted = interpreted_test(__file__, CHECKS)

if __name__ == "__main__":
    main(CHECKS)
