"""The cross-entropy gradient's CUDA kernel: the reference kernel's bits wherever ``exp`` is normal, in one pass.

``tpinv::cross_entropy_grad`` on CUDA runs one Triton pass (:mod:`tpinv.kernels.triton_cross_entropy`):
bitwise (shape, dtype, raw bytes) the reference kernel's torch code run on the same CUDA tensors
at every entry whose exponential is a normal float, for bf16, fp16 and fp32 logits, shifts
``x - lse`` from 0 down to -190, targets inside and outside the slice, and upstream gradients of
both signs and zero.  Below that (``exp`` under 2**-126, a gradient entry under about 1e-38)
libdevice's ``exp`` and ATen's may differ in the subnormal bits (seen: 1 to 7 entries of 4.9
million, libdevice subnormal where ATen gave 0); the kernel is the one every CUDA path runs,
so paths agree with each other bit for bit.  A column slice with its targets shifted gives
those columns of the whole row.  The
unchunked and the chunked output layer keep their loss and gradients bitwise equal, and the
unchunked backward holds no fp32 buffer of the logits' size.  Negative control: the same kernel
with Triton's approximate ``exp`` (``ex2.approx``) gives other bits on the same inputs.
Skips without CUDA.
"""
from __future__ import annotations

import gc

import pytest
import torch

from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda"


def _inputs(rows, v, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(rows, v, device=DEV, generator=g) * 4).to(dtype)
    # lse per row puts x - lse anywhere from about 0 down to -200
    lse = x.float().amax(-1) + torch.linspace(0.0, 190.0, rows, device=DEV)
    target = torch.randint(-v // 4, v + v // 4, (rows,), device=DEV, generator=g)
    outside = (target < 0) | (target >= v)
    dloss = torch.randn(rows, device=DEV, generator=g)
    dloss[::7] = 0.0
    return x, lse, target.masked_fill(outside, 0), outside, dloss


def _kernels():
    from tpinv.kernels import triton_cross_entropy
    from tpinv.kernels.reference_cross_entropy import cross_entropy_grad
    from tpinv.ops.cross_entropy import cross_entropy_grad_op
    return triton_cross_entropy, cross_entropy_grad_op, cross_entropy_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_equals_the_reference(dtype):
    tce, op, ref = _kernels()
    args = _inputs(257, 151936 // 8 + 3, dtype)
    got = tce.cross_entropy_grad_cuda(*args)
    want = ref(*args)
    normal = torch.exp(args[0].float() - args[1].unsqueeze(-1)) >= torch.finfo(torch.float32).tiny
    assert bool((~normal).any()) and bool(normal.any())      # both ranges are exercised
    assert_same_bits(got[normal], want[normal], 'cross_entropy_grad_cuda (normal exp)')
    assert float((got[~normal].float() - want[~normal].float()).abs().max()) < torch.finfo(torch.float32).tiny
    assert_same_bits(op(*args), got, 'tpinv::cross_entropy_grad on CUDA')


def test_slices_and_rows_are_their_own():
    tce, _, _ = _kernels()
    x, lse, target, outside, dloss = _inputs(64, 4096, torch.bfloat16, seed=1)
    whole = tce.cross_entropy_grad_cuda(x, lse, target, outside, dloss)
    lo, hi = 1000, 3000
    local = target - lo
    off = outside | (local < 0) | (local >= hi - lo)
    part = tce.cross_entropy_grad_cuda(x[:, lo:hi], lse, local.masked_fill(off, 0), off, dloss)
    assert_same_bits(part, whole[:, lo:hi].contiguous(), 'column slice')
    assert_same_bits(tce.cross_entropy_grad_cuda(x[5:6], lse[5:6], target[5:6], outside[5:6], dloss[5:6]),
                     whole[5:6], 'one row alone')


def test_negative_control_approximate_exp_differs():
    tce, _, ref = _kernels()
    from tpinv.kernels.launch import cdiv
    x, lse, target, outside, dloss = _inputs(128, 8192, torch.float32, seed=2)
    out = torch.empty_like(x)
    tce._ce_grad_kernel[(x.shape[0], cdiv(x.shape[1], tce.GRAD_BLOCK))](
        x, lse, target, outside.view(torch.uint8), dloss, out, x.shape[1], x.stride(0), out.stride(0),
        BLOCK=tce.GRAD_BLOCK, PRECISE_EXP=False, num_warps=8, enable_fp_fusion=False)
    assert_bits_differ(out, ref(x, lse, target, outside, dloss), 'ex2.approx exp')


def test_unchunked_backward_holds_no_fp32_logits():
    """The whole-vocabulary path saves the bf16 logits and writes a bf16 gradient: its peak is
    below what one fp32 buffer of the logits' size would add (the chunked path's bits against
    this one: tests/gpu/test_logits_memory_cuda.py)."""
    from tpinv.layers import vocab_parallel_cross_entropy
    from tpinv.layers.functions import ColumnParallelMatmul
    T, H, V = 2048, 1024, 151936
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEV).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(torch.bfloat16).to(DEV).requires_grad_()
    target = torch.randint(0, V, (T,), generator=g).to(DEV)
    seed = torch.randn(T, generator=g).to(DEV)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = vocab_parallel_cross_entropy(ColumnParallelMatmul.apply(hidden, weight, None, None, 8, True), target)
    torch.autograd.grad(loss, (hidden, weight), seed)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    logits_bf16, dw_bf16, fp32_copy = T * V * 2, V * H * 2, T * V * 4
    assert peak < 2 * logits_bf16 + dw_bf16 + (128 << 20) < 2 * logits_bf16 + dw_bf16 + fp32_copy, \
        f"peak {peak / 2**30:.2f} GiB"
