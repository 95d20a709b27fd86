"""The cross-entropy gradient on CUDA (Triton): elementwise, so every entry's bits are its own.

Per entry of a row of logits ``x`` (bf16, fp16 or fp32), given the row's fp32 ``lse``, target
and upstream ``dloss``::

    g = exp(float(x) - lse)          libdevice's exp, IEEE subnormals kept
    g = g + (-1)    at the target column of a row whose target this slice holds
    g = g * dloss, rounded once to x's dtype

-- the arithmetic of the reference kernel (:mod:`tpinv.kernels.reference_cross_entropy`),
one IEEE operation each, compiled without mul+add contraction, in one pass: the logits are
read once in their own dtype and the gradient written once, no fp32 buffer of the logits' size.
The reference run on CUDA gives the same bits wherever ``exp`` is a normal float; below 2**-126
libdevice's ``exp`` and ATen's may differ in the subnormal bits (tests/gpu/test_cross_entropy_cuda.py).
An entry depends on its own logit and its row's three values only: not on the grid, the block,
the other rows or which vocabulary columns share the call.  Where Triton links libdevice in
flush-to-zero mode only (Triton 3.2, 3.3), ``exp`` of a very negative shift would flush, so
there the reference kernel runs instead (same bits, more passes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpinv.kernels import reference_cross_entropy
from tpinv.kernels.launch import cdiv, launch, rows_2d
from tpinv.kernels.triton_elementwise import EXACT_OPTIONS, exp_f32, interpreting

__all__ = ["cross_entropy_grad_cuda", "GRAD_BLOCK"]

#: Columns per program (a speed choice: no entry depends on it).
GRAD_BLOCK = 4096


@triton.jit
def _ce_grad_kernel(x_ptr, lse_ptr, target_ptr, outside_ptr, dloss_ptr, out_ptr, V, stride_x, stride_o,
                    BLOCK: tl.constexpr, PRECISE_EXP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    target = tl.load(target_ptr + row)
    held = tl.load(outside_ptr + row) == 0
    g = exp_f32(x - lse, PRECISE_EXP)
    g = tl.where((cols == target) & held, g + (-1.0), g)
    g = g * tl.load(dloss_ptr + row)
    tl.store(out_ptr + row * stride_o + cols, g.to(out_ptr.dtype.element_ty), mask=ok)


def cross_entropy_grad_cuda(x: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, outside: torch.Tensor,
                            dloss: torch.Tensor) -> torch.Tensor:
    """``(exp(x - lse) - onehot(target)) * dloss`` in ``x.dtype`` (inputs checked by the op)."""
    if "enable_reflect_ftz" not in EXACT_OPTIONS and not interpreting():
        return reference_cross_entropy.cross_entropy_grad(x, lse, target, outside, dloss)
    v = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2, o2 = rows_2d(x), out.view(-1, v)
    rows = x2.shape[0]
    flat = [t.reshape(-1).contiguous() for t in (lse, target, outside.view(torch.uint8), dloss)]
    launch(_ce_grad_kernel, (rows, cdiv(v, GRAD_BLOCK)), x2, *flat, o2, v, x2.stride(0), o2.stride(0),
           BLOCK=GRAD_BLOCK, PRECISE_EXP=not interpreting(), num_warps=8, **EXACT_OPTIONS)
    return out
