"""The interpreter's dot in the tests' child processes (:func:`triton_interp.fixed_order_dot`).

The kernels rely on a GPU dot's row not depending on its place in the tile; the interpreter's own
dot (numpy's BLAS) need not have that, so the tests' interpreter runs a fixed-order dot instead.
Checks, under the interpreter, through a real ``tl.dot`` in a kernel:

* a row gives the same bytes at each of the tile's 32 rows (fp32 and fp16 inputs), and a column
  at each of its 32 columns;
* by construction: a row ``1, 2^-24, 0, 2^-24`` against ones is ``1 + 2^-23`` (the halving pairs
  ``1 + 0`` and ``2^-24 + 2^-24``), where the chain in index order gives ``1``.
"""
from __future__ import annotations

import importlib.util
import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from triton_interp import checks_of, interpreted_test, main  # noqa: E402
from tpinv.testing import assert_same_bits  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
M = N = 32
K = 64


def _dot(a, b):
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        x = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        y = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(x, y, input_precision="ieee"))

    c = torch.empty(M, N, dtype=torch.float32)
    dot_kernel[(1,)](a.contiguous(), b.contiguous(), c, M, N, K)
    return c


def check_a_row_and_a_column_give_the_same_bits_at_every_place():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        a = (torch.randn(M, K, generator=gen) * torch.logspace(-3, 3, K)).to(dtype)
        b = torch.randn(K, N, generator=gen).to(dtype)
        base = _dot(a, b)
        for r in range(M):
            moved = torch.zeros_like(a)
            moved[r] = a[0]
            assert_same_bits(_dot(moved, b)[r], base[0], f"{dtype} row 0 at row {r}")
        for c in range(N):
            moved = torch.zeros_like(b)
            moved[:, c] = b[:, 0]
            assert_same_bits(_dot(a, moved)[:, c], base[:, 0], f"{dtype} column 0 at column {c}")


def check_the_sum_is_the_halving_not_the_chain():
    a = torch.zeros(M, K)
    a[:, :4] = torch.tensor([1.0, 2.0 ** -24, 0.0, 2.0 ** -24])
    b = torch.zeros(K, N)
    b[:4] = 1.0
    chain = ((a[0, 0] + a[0, 1]) + a[0, 2]) + a[0, 3]
    assert chain.item() == 1.0
    got = _dot(a, b)
    assert_same_bits(got, torch.full((M, N), 1.0 + 2.0 ** -23), "the halving of 1, 2^-24, 0, 2^-24")


CHECKS = checks_of(dict(globals()))
test_interpreted_dot = interpreted_test(__file__, CHECKS)

if __name__ == "__main__":
    main(CHECKS)
