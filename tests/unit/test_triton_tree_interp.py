"""The one-launch halving sum (tpinv.kernels.triton_tree) under Triton's interpreter: the bits of
the reference's per-level adds, for lengths around powers of two, strided rows, many rows; fp16
inputs read as fp32 and sums stored rounded once to fp16 (the interpreter computes in numpy,
which has no bfloat16 and truncates to it: bfloat16 is checked on the GPU,
``tests/gpu/test_triton_tree.py``).  Controls: a sum in another pairing (adjacent pairs first)
differs; adds rounded to fp16 at every level differ."""
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


def check_16_bit_inputs_and_outputs():
    """``kernel(x, out)`` == ``ref(x.float()).to(out)`` for fp32/fp16 inputs and outputs."""
    ref, kernel = _kernels()
    gen = torch.Generator().manual_seed(2)
    for rows, n in [(3, 1), (5, 3), (17, 64), (9, 300)]:
        x = torch.randn(rows, n, generator=gen) * torch.logspace(-3, 3, n)
        for dtype in (torch.float32, torch.float16):
            xd = x.to(dtype)
            for out in (torch.float32, torch.float16):
                got = kernel(xd.t().contiguous().t(), out)
                assert_same_bits(got, ref(xd.float()).to(out), f"{rows}x{n} {dtype} -> {out}")


def check_tree_sum_cuda_slot_reads_the_input_dtype():
    """``tpinv::tree_sum``'s CUDA adapter (one leaf: the kernel on ``x`` as it is) == the reference
    on ``x.float()``, for fp32/fp16 inputs of 1 to 3 dims; more leaves run the reference itself."""
    from tpinv.kernels.reference_tree import leaf_tree_sum
    from tpinv.ops.linear import _tree_sum_cuda
    gen = torch.Generator().manual_seed(3)
    for shape in [(7,), (3, 5, 96), (4, 300)]:
        x = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[-1])
        for dtype in (torch.float32, torch.float16):
            xd = x.to(dtype)
            assert_same_bits(_tree_sum_cuda(xd, 1), leaf_tree_sum(xd.float(), 1), f"{shape} {dtype}")
            if shape[-1] % 2 == 0:
                assert_same_bits(_tree_sum_cuda(xd, 2), leaf_tree_sum(xd.float(), 2), f"{shape} {dtype}, 2 leaves")


def check_control_fp16_adds_at_every_level_differ():
    """``[1, 2^-11, 2^-11, 2^-11]``: fp32 adds then one rounding give 1 + 2^-9 in fp16; rounding
    each level to fp16 gives 1 + 2^-10 (1 + 2^-11 ties to 1 first)."""
    _, kernel = _kernels()
    x = torch.tensor([[1.0, 2.0 ** -11, 2.0 ** -11, 2.0 ** -11]], dtype=torch.float16)
    got = kernel(x, torch.float16)
    assert_same_bits(got, torch.tensor([1.0 + 2.0 ** -9], dtype=torch.float16), "one rounding")
    per_level = (x[:, :2] + x[:, 2:])
    per_level = per_level[:, :1] + per_level[:, 1:]
    assert_bits_differ(got, per_level[:, 0], "control: fp16 adds at every level")


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
