"""On CUDA, the one-launch halving sum gives the bits of the per-level tensor adds it replaces
(norm weight gradients, bias gradients, tree sums).  Control: adjacent pairing differs."""
from __future__ import annotations

import pytest
import torch

from tpinv.kernels.triton_tree import halving_sum_cuda
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _per_level(x):
    n = x.shape[-1]
    p = 1 if n <= 1 else 1 << (n - 1).bit_length()
    x = torch.nn.functional.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x.squeeze(-1)


@pytest.mark.parametrize("rows,n", [(1, 1), (7, 3), (1024, 4096), (1024, 4097), (3, 65536), (16, 1000)])
def test_one_launch_equals_per_level_adds(rows, n):
    gen = torch.Generator().manual_seed(rows + n)
    x = (torch.randn(n, rows, generator=gen) * torch.logspace(-3, 3, n)[:, None]).cuda()
    assert_same_bits(halving_sum_cuda(x.t()), _per_level(x.t()), f"{rows}x{n} (token-major)")
    y = x.t().contiguous()
    assert_same_bits(halving_sum_cuda(y), _per_level(y), f"{rows}x{n} (row-major)")
    if n >= 4:
        adjacent = y
        while adjacent.shape[-1] > 1 and adjacent.shape[-1] % 2 == 0:
            adjacent = adjacent[..., 0::2] + adjacent[..., 1::2]
        if adjacent.shape[-1] == 1:
            assert_bits_differ(halving_sum_cuda(y), adjacent[..., 0], "control: adjacent pairing")
