"""The one-launch halving sum (tpinv.kernels.triton_tree) under Triton's interpreter: the bits of
the reference's per-level adds, for lengths around powers of two, strided rows, many rows.
Control: a sum in another pairing (adjacent pairs first) differs."""
from __future__ import annotations

import torch

from tests.unit.triton_interp import checks_of, interpreted_test, main
from tpinv.testing import assert_bits_differ, assert_same_bits


def _kernels():
    from tpinv.kernels.reference_tree import halving_sum
    from tpinv.kernels.triton_tree import halving_sum_cuda
    return halving_sum, halving_sum_cuda


def check_equals_reference_adds():
    ref, kernel = _kernels()
    gen = torch.Generator().manual_seed(0)
    for rows, n in [(1, 1), (3, 2), (5, 3), (17, 64), (40, 129), (16, 300), (2, 1000), (4, 0)]:
        x = torch.randn(rows, n, generator=gen) * torch.logspace(-3, 3, n)
        assert_same_bits(kernel(x), ref(x), f"{rows}x{n}")
        assert_same_bits(kernel(x.t().contiguous().t()), ref(x), f"{rows}x{n} strided")


def check_control_adjacent_pairing_differs():
    _, kernel = _kernels()
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 4, 256)
    adjacent = x
    while adjacent.shape[-1] > 1:
        adjacent = adjacent[..., 0::2] + adjacent[..., 1::2]
    assert_bits_differ(kernel(x), adjacent[..., 0], "control: adjacent pairing")


CHECKS = checks_of(dict(globals()))
test_interpreted_kernel = interpreted_test(__file__, CHECKS)

if __name__ == "__main__":
    main(CHECKS)
