"""RMSNorm on CUDA (Triton): a row's bits depend on that row, ``H`` and the dtypes only.

Order fixed: one program per row loads the whole row into a block of
``BLOCK = next_power_of_two(H)`` lanes (masked lanes are zero) and reduces it with one
``tl.sum`` over that block, so the reduction tree is a function of ``H`` alone -- never of
the number of rows, the row's position or padding rows.  The semantics are those of
:mod:`tpinv.kernels.reference_norm` (``n = x * rsqrt(sum(x*x) / H + eps)`` with a correctly
rounded division, ``y = n.to(x.dtype) * weight`` rounded once); the bits may differ from the
CPU kernel (another reduction tree, another ``rsqrt``).

Backward: ``dx`` per row with the same per-row reduction shape.  ``dweight`` is a sum over
tokens: each program writes its row's fp32 contributions ``g * n`` to a ``[T, H]`` buffer,
and the token sum is :func:`tpinv.kernels.reference_tree.leaf_tree_sum` ``(., 1)`` over that
buffer (zero padding to a power of two, contiguous halving), so zero-gradient padding
tokens appended after the real ones leave ``dweight`` unchanged.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpinv.kernels.launch import launch, next_power_of_2, rows_2d
from tpinv.kernels.reference_norm import (check_per_head_inputs, check_rms_norm_backward_inputs, check_rms_norm_inputs,
                                    rms_norm_backward, rms_norm_backward_heads, rms_norm_forward,
                                    rms_norm_out_dtype, sum_over_tokens_per_head)
from tpinv.kernels.reference_tree import leaf_tree_sum

__all__ = ["rms_norm_forward_cuda", "rms_norm_backward_cuda", "rms_norm_backward_heads_cuda",
           "MAX_HIDDEN"]

#: Largest hidden size one program holds in registers (one row per program); wider rows run
#: the fixed-order torch code of :mod:`tpinv.kernels.reference_norm` (also a function of ``H`` only).
MAX_HIDDEN = 65536


@triton.jit
def _rms_reciprocal(x, hidden_f, eps):
    mean_square = tl.math.div_rn(tl.sum(x * x, axis=0), hidden_f)
    return tl.math.rsqrt(mean_square + eps)


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, hidden, hidden_f, eps, stride_x, stride_y,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    x_raw = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    x = x_raw.to(tl.float32)
    r = _rms_reciprocal(x, hidden_f, eps)
    normed = (x * r).to(x_raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_bwd_kernel(g_ptr, x_ptr, w_ptr, dx_ptr, contrib_ptr, hidden, hidden_f, eps,
                         stride_g, stride_x, stride_dx, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    x_raw = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    x = x_raw.to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    r = _rms_reciprocal(x, hidden_f, eps)
    normed = (x * r).to(x_raw.dtype).to(tl.float32)
    tl.store(contrib_ptr + row * hidden + offs, g * normed, mask=ok)
    g_n = g * w
    dot = tl.sum(g_n * x, axis=0)
    coeff = tl.math.div_rn(((r * r) * r) * dot, hidden_f)
    dx = g_n * r - x * coeff
    tl.store(dx_ptr + row * stride_dx + offs, dx.to(dx_ptr.dtype.element_ty), mask=ok)


def _block_for(hidden: int) -> tuple[int, int]:
    block = next_power_of_2(hidden)
    warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    return block, warps



def rms_norm_forward_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``; one program per row."""
    check_rms_norm_inputs(x, weight, eps)
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        return rms_norm_forward(x, weight, eps)
    rows = rows_2d(x)
    out = torch.empty(rows.shape, dtype=rms_norm_out_dtype(x, weight), device=x.device)
    if rows.shape[0]:
        block, warps = _block_for(hidden)
        launch(_rms_norm_fwd_kernel, (rows.shape[0],), rows, weight.contiguous(), out, hidden, float(hidden),
                                               float(eps),
                                               rows.stride(0), out.stride(0), BLOCK=block,
                                               num_warps=warps)
    return out.reshape(x.shape)


def _backward_rows(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx`` (x's shape) and the fp32 ``[rows, H]`` weight-gradient contributions."""
    hidden = x.shape[-1]
    rows, grads = rows_2d(x), rows_2d(grad)
    n_rows = rows.shape[0]
    grad_x = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    contrib = torch.empty((n_rows, hidden), dtype=torch.float32, device=x.device)
    if n_rows:
        block, warps = _block_for(hidden)
        launch(_rms_norm_bwd_kernel, (n_rows,), grads, rows, weight.contiguous(), grad_x, contrib, hidden,
                                        float(hidden), float(eps), grads.stride(0), rows.stride(0),
                                        grad_x.stride(0), BLOCK=block, num_warps=warps)
    return grad_x.reshape(x.shape), contrib


def rms_norm_backward_cuda(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` in ``x.dtype`` / ``weight.dtype``; see the module docstring."""
    check_rms_norm_backward_inputs(grad, x, weight, eps)
    if x.shape[-1] > MAX_HIDDEN:
        return rms_norm_backward(grad, x, weight, eps)
    grad_x, contrib = _backward_rows(grad, x, weight, eps)
    grad_weight = leaf_tree_sum(contrib.transpose(0, 1), 1).to(weight.dtype)
    return grad_x, grad_weight


def rms_norm_backward_heads_cuda(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight per head [heads, H])`` for ``x [..., heads, H]``: one launch for all
    heads; head ``h``'s row has the bits :func:`rms_norm_backward_cuda` gives its slice."""
    check_rms_norm_backward_inputs(grad, x, weight, eps)
    check_per_head_inputs(x)
    if x.shape[-1] > MAX_HIDDEN:
        return rms_norm_backward_heads(grad, x, weight, eps)
    grad_x, contrib = _backward_rows(grad, x, weight, eps)
    heads = sum_over_tokens_per_head(contrib.view(-1, x.shape[-2], x.shape[-1]))
    return grad_x, heads.to(weight.dtype)
