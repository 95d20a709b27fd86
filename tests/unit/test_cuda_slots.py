"""Every tpinv op has a CUDA kernel that keeps the contract's order -- never a cuBLAS/aten fallback.

The matmul ops hold the Triton contract kernel, the ops of ``cuda_torch.TRITON_CUDA_KERNELS``
their Triton kernels, the others their own fixed-order torch code (``tpinv.ops.cuda_torch``);
a slot nobody filled raises instead of computing.
"""
import importlib

import pytest
import torch

import tpinv.ops  # noqa: F401  (registers every op and its CUDA slot)
from tpinv.ops import cuda_torch
from tpinv.ops.linear import matmul_op, matmul_partial_op
from tpinv.ops.registry import cuda_kernel, define_op, has_cuda_kernel, missing_cuda_kernel


def test_matmul_slots_hold_the_triton_kernel():
    from tpinv.ops.linear import _matmul_cuda, _matmul_partial_cuda

    assert cuda_kernel(matmul_op) is _matmul_cuda and cuda_kernel(matmul_partial_op) is _matmul_partial_cuda


@pytest.mark.parametrize("op", cuda_torch.TORCH_CUDA_OPS, ids=lambda op: op._qualname)
def test_other_slots_hold_the_ops_own_fixed_order_code(op):
    assert has_cuda_kernel(op)
    assert cuda_kernel(op) is op._init_fn  # the very function the CPU slot runs


@pytest.mark.parametrize("op,kernel", cuda_torch.TRITON_CUDA_KERNELS, ids=lambda o: getattr(o, "_qualname", ""))
def test_triton_slots_hold_their_kernel(op, kernel):
    """The slot holds the table's lazy kernel, and the Triton function it names exists
    (tests/gpu runs them)."""
    assert has_cuda_kernel(op) and cuda_kernel(op) is kernel
    assert callable(getattr(importlib.import_module(kernel.triton_module), kernel.triton_name))


def test_an_unfilled_slot_raises_instead_of_falling_back():
    placeholder = missing_cuda_kernel("tpinv::example")
    with pytest.raises(NotImplementedError, match="tpinv::example has no CUDA kernel yet"):
        placeholder(torch.zeros(1))

    @define_op("cuda_slot_probe")
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    assert not has_cuda_kernel(probe)
    with pytest.raises(NotImplementedError, match="tpinv::cuda_slot_probe has no CUDA kernel yet"):
        cuda_kernel(probe)(torch.zeros(1))
