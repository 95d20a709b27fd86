"""The cross-entropy gradient's Triton kernel under the Triton interpreter (CPU).

Bitwise (``assert_same_bits``): a row alone, a column slice with its targets shifted, and a
strided view give those entries of the whole call; the target entry of a held row is the entry
plus -1 and a row whose target another slice holds has none; the result is rounded once to the
logits' dtype.  Parity with the reference kernel is to an ulp of ``exp`` (the interpreter's
``exp`` is numpy's; on the GPU the kernel calls libdevice's and equals the reference bit for bit:
tests/gpu/test_cross_entropy_cuda.py).  Negative control: another row's ``lse`` changes a row.
The checks run in one child process with the interpreter on (:mod:`triton_interp`).
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from triton_interp import checks_of, interpreted_test, main

if __name__ == "__main__":  # the subprocess: interpret before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _inputs(rows=6, v=5000, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, v, generator=g) * 4).to(dtype)
    lse = x.float().amax(-1) + torch.linspace(0.0, 30.0, rows)
    target = torch.randint(-v // 4, v + v // 4, (rows,), generator=g)
    outside = (target < 0) | (target >= v)
    dloss = torch.randn(rows, generator=g)
    return x, lse, target.masked_fill(outside, 0), outside, dloss


def _grad(*args):
    from tpinv.kernels.triton_cross_entropy import cross_entropy_grad_cuda
    return cross_entropy_grad_cuda(*args)


def check_rows_slices_and_views_are_their_own():
    x, lse, target, outside, dloss = _inputs()
    whole = _grad(x, lse, target, outside, dloss)
    assert whole.dtype == x.dtype and whole.shape == x.shape
    assert_same_bits(_grad(x[2:3], lse[2:3], target[2:3], outside[2:3], dloss[2:3]), whole[2:3], 'one row')
    lo, hi = 700, 4100
    local = target - lo
    off = outside | (local < 0) | (local >= hi - lo)
    assert_same_bits(_grad(x[:, lo:hi], lse, local.masked_fill(off, 0), off, dloss),
                     whole[:, lo:hi].contiguous(), 'column slice')
    wide = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
    wide[:, ::2] = x
    assert_same_bits(_grad(wide[:, ::2], lse, target, outside, dloss), whole, 'strided view')
    assert_bits_differ(_grad(x, lse.roll(1), target, outside, dloss), whole, 'rolled lse')


def check_target_and_rounding():
    x, lse, target, outside, dloss = _inputs(dtype=torch.float32)
    got = _grad(x, lse, target, outside, dloss)
    base = _grad(x, lse, target, torch.ones_like(outside), dloss)    # no row holds its target
    for r in range(x.shape[0]):
        t = int(target[r])
        if outside[r]:
            assert_same_bits(got[r], base[r], f'row {r} (target elsewhere)')
        else:
            e = torch.exp(x[r, t] - lse[r])      # the interpreter's exp may differ by an ulp
            torch.testing.assert_close(got[r, t], (e + (-1.0)) * dloss[r], rtol=1e-6, atol=1e-7)
            keep = torch.arange(x.shape[1]) != t
            assert_same_bits(got[r][keep], base[r][keep], f'row {r} off its target')
    from tpinv.kernels.reference_cross_entropy import cross_entropy_grad
    torch.testing.assert_close(got, cross_entropy_grad(x, lse, target, outside, dloss),
                               rtol=1e-6, atol=1e-7)
    # fp16 (numpy's half, rounded to nearest even; the interpreter's bf16 cast is its own, not
    # the GPU's: tests/gpu checks bf16)
    rounded = _grad(x.half(), lse, target, outside, dloss)
    assert_same_bits(rounded, _grad(x.half().float(), lse, target, outside, dloss).half(),
                     'fp16 logits: fp32 arithmetic, one rounding')


CHECKS = checks_of(dict(globals()))
test_interpreted_kernel = interpreted_test(__file__, CHECKS)

if __name__ == "__main__":
    main(CHECKS)
