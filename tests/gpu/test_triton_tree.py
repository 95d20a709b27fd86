"""On CUDA, the one-launch halving sum gives the bits of the per-level tensor adds it replaces
(norm weight gradients, bias gradients, tree sums).  Control: adjacent pairing differs."""
from __future__ import annotations

import pytest
import torch

from tpinv.core.contract import tree_combine
from tpinv.kernels.reference_tree import leaf_partials, leaf_tree_sum
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


@pytest.mark.parametrize("step,heads,hidden", [(1, 1, 8), (5, 1, 1000), (512, 16, 128), (1024, 1, 1024)])
def test_one_leaf_reduction_is_the_leaf_chain_alone(step, heads, hidden):
    """On CUDA, ``leaf_tree_sum(x, 1)``'s one-leaf path == ``tree_combine(leaf_partials(x, 1))``,
    raw bytes, on the RMSNorm backward's strided token partials ``[heads, H, P]``.  Control:
    ``2^24, 1, 1, -2^24`` gives 1 by the halving, 0 left to right."""
    gen = torch.Generator().manual_seed(step + heads)
    partials = torch.randn(step, heads, hidden, generator=gen).cuda().permute(1, 2, 0)
    assert_same_bits(leaf_tree_sum(partials, 1), tree_combine(leaf_partials(partials, 1)),
                     f"P={step} heads={heads} H={hidden}")
    big = float(2 ** 24)
    row = torch.tensor([[big, 1.0, 1.0, -big]], device="cuda")
    assert_same_bits(leaf_tree_sum(row, 1), torch.ones(1, device="cuda"), "the halving's pairs")
    assert_bits_differ(leaf_tree_sum(row, 1), ((row[:, 0] + row[:, 1]) + row[:, 2]) + row[:, 3],
                       "control: left to right")
