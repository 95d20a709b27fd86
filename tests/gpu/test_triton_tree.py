"""On CUDA, the one-launch halving sum gives the bits of the per-level tensor adds it replaces
(norm weight gradients, bias gradients, tree sums), reading 16-bit inputs as fp32 and rounding
its sums once to a 16-bit dtype where asked (as ``.to`` after it would).  Controls: adjacent
pairing differs; rounding every level to bfloat16 differs."""
from __future__ import annotations

import pytest
import torch

from tpinv.core.contract import tree_combine
from tpinv.kernels.reference_tree import leaf_partials, leaf_tree_sum
from tpinv.kernels.triton_tree import halving_sum_cuda
from tpinv.ops import tree_sum
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16, torch.float16])
def test_16_bit_inputs_and_rounded_sums(dtype, out):
    """``halving_sum_cuda(x, out)`` == the per-level fp32 adds of ``x.float()``, then ``.to(out)``;
    and the ``tree_sum`` op (one leaf) on ``x`` == the reference on ``x.float()``."""
    gen = torch.Generator().manual_seed(5)
    for rows, n in [(3, 1), (7, 3), (2048, 512), (1024, 4097)]:
        x = (torch.randn(n, rows, generator=gen) * torch.logspace(-3, 3, n)[:, None]).to(dtype).cuda()
        want = _per_level(x.t().float())
        assert_same_bits(halving_sum_cuda(x.t(), out), want.to(out), f"{rows}x{n} {dtype} -> {out}")
        assert_same_bits(tree_sum(x.t(), 1), leaf_tree_sum(x.t().float(), 1), f"tree_sum {rows}x{n} {dtype}")


def test_control_bfloat16_adds_at_every_level_differ():
    """``[1, 2^-8, 2^-8, 2^-8]``: fp32 adds then one rounding give 1 + 2^-6 in bfloat16; rounding
    each level to bfloat16 gives 1 + 2^-7 (1 + 2^-8 ties to 1 first)."""
    x = torch.tensor([[1.0, 2.0 ** -8, 2.0 ** -8, 2.0 ** -8]], dtype=torch.bfloat16, device="cuda")
    got = halving_sum_cuda(x, torch.bfloat16)
    assert_same_bits(got, torch.tensor([1.0 + 2.0 ** -6], dtype=torch.bfloat16, device="cuda"), "one rounding")
    per_level = x[:, :2] + x[:, 2:]
    assert_bits_differ(got, (per_level[:, :1] + per_level[:, 1:])[:, 0], "control: bfloat16 adds at every level")
