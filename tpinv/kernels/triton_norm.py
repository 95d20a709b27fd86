"""RMSNorm on CUDA (Triton): a row's bits depend on that row, ``H`` and the dtypes only.

Order fixed: a program holds a tile of ``ROWS`` rows of ``BLOCK = next_power_of_two(H)``
lanes (masked lanes are zero) and reduces each row with one ``tl.sum`` over its lanes.
``BLOCK``, ``ROWS`` and the warps are functions of ``H`` alone (:func:`tile_for`), so a row's
reduction tree is the same in every slot of every tile -- never a function of the number of
rows, the row's position or padding rows.  The semantics are those of
:mod:`tpinv.kernels.reference_norm` (``n = x * rsqrt(sum(x*x) / H + eps)`` with a correctly
rounded division, ``y = n.to(x.dtype) * weight`` rounded once); the bits may differ from the
CPU kernel (another reduction tree, another ``rsqrt``).

Backward: ``dx`` per row with the same tile and per-row reduction.  ``dweight`` is the sum
over tokens of the fp32 contributions ``g * n``, by contiguous halving over the tokens
zero-padded to ``N = max(next_pow2(T), ROWS)`` (:func:`tpinv.kernels.reference_tree.halving_sum`'s
pairing).  The first ``log2(ROWS)`` levels run inside the backward kernel: program ``p`` takes
the tokens ``p, p + P, ..., p + (ROWS-1)P`` (``P = N / ROWS``) -- exactly the tokens those
levels add into partial ``p`` -- and adds them in that pairing (each add a two-term sum, exact
in any order); the remaining levels are the halving sum of the ``P`` partials.  So the kernel
writes ``[P, H]`` partials instead of ``[T, H]`` contributions, and zero-gradient padding tokens
appended after the real ones leave ``dweight`` unchanged (up to the sign of an all-zero sum).
The per-head variant runs the same programs once per head.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpinv.kernels.launch import launch, next_power_of_2, rows_2d
from tpinv.kernels.reference_norm import (check_per_head_inputs, check_rms_norm_backward_inputs, check_rms_norm_inputs,
                                    rms_norm_backward, rms_norm_backward_heads, rms_norm_forward,
                                    rms_norm_out_dtype)
from tpinv.kernels.triton_tree import halving_sum_cuda

__all__ = ["rms_norm_forward_cuda", "rms_norm_backward_cuda", "rms_norm_backward_heads_cuda",
           "tile_for", "MAX_HIDDEN", "LANES_PER_THREAD"]

#: Largest hidden size one program holds in registers (one row per program); wider rows run
#: the fixed-order torch code of :mod:`tpinv.kernels.reference_norm` (also a function of ``H`` only).
MAX_HIDDEN = 65536
#: Lanes each thread holds: the warps of a tile are ``ROWS * BLOCK / (32 * LANES_PER_THREAD)``,
#: 1 to 16 (from an H100 sweep of rows and warps, ``docs/benchmarks.md``, 2026-11-26).
LANES_PER_THREAD = 32


def tile_for(hidden: int) -> tuple[int, int, int]:
    """``(BLOCK, ROWS, warps)`` of a tile: a function of ``hidden`` alone (the bits' contract).

    Rows per tile: 8 for ``BLOCK <= 128``, 4 for 256, 2 up to 8192, 1 above.
    """
    block = next_power_of_2(hidden)
    rows = 8 if block <= 128 else (4 if block == 256 else (2 if block <= 8192 else 1))
    warps = max(1, min(16, rows * block // (32 * LANES_PER_THREAD)))
    return block, rows, warps


@triton.jit
def _rms_reciprocal(x, hidden_f, eps):
    mean_square = tl.math.div_rn(tl.sum(x * x, axis=1), hidden_f)
    return tl.math.rsqrt(mean_square + eps)[:, None]


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, n_rows, hidden, hidden_f, eps, stride_x, stride_y,
                         BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    ok = (rows < n_rows)[:, None] & (offs < hidden)[None, :]
    x_raw = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=ok, other=0.0)
    x = x_raw.to(tl.float32)
    r = _rms_reciprocal(x, hidden_f, eps)
    normed = (x * r).to(x_raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < hidden, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + offs[None, :], (normed * w[None, :]).to(y_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _rms_norm_bwd_kernel(g_ptr, x_ptr, w_ptr, dx_ptr, part_ptr, tokens, token_step, heads, hidden, hidden_f,
                         eps, stride_g, stride_x, stride_dx, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                         LEVELS: tl.constexpr):
    p = tl.program_id(0)
    head = tl.program_id(1)
    token = p + tl.arange(0, ROWS).to(tl.int64) * token_step
    rows = token * heads + head
    offs = tl.arange(0, BLOCK)
    row_ok = token < tokens
    ok = row_ok[:, None] & (offs < hidden)[None, :]
    x_raw = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=ok, other=0.0)
    x = x_raw.to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * stride_g + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < hidden, other=0.0).to(tl.float32)
    r = _rms_reciprocal(x, hidden_f, eps)
    normed = (x * r).to(x_raw.dtype).to(tl.float32)
    g_n = g * w[None, :]
    dot = tl.sum(g_n * x, axis=1)[:, None]
    coeff = tl.math.div_rn(((r * r) * r) * dot, hidden_f)
    dx = g_n * r - x * coeff
    tl.store(dx_ptr + rows[:, None] * stride_dx + offs[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)
    # the token sum's first log2(ROWS) halving levels: slot j meets slot j + half
    part = tl.where(row_ok[:, None], g * normed, 0.0)
    for level in tl.static_range(LEVELS):
        part = tl.sum(tl.reshape(part, (2, ROWS >> (level + 1), BLOCK)), axis=0)
    out = (p * heads + head).to(tl.int64) * hidden
    tl.store(part_ptr + out + offs[None, :], part, mask=(offs < hidden)[None, :])


def rms_norm_forward_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``; ``ROWS`` rows per program."""
    check_rms_norm_inputs(x, weight, eps)
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        return rms_norm_forward(x, weight, eps)
    rows = rows_2d(x)
    out = torch.empty(rows.shape, dtype=rms_norm_out_dtype(x, weight), device=x.device)
    n_rows = rows.shape[0]
    if n_rows:
        block, tile_rows, warps = tile_for(hidden)
        launch(_rms_norm_fwd_kernel, ((n_rows + tile_rows - 1) // tile_rows,), rows, weight.contiguous(), out,
               n_rows, hidden, float(hidden), float(eps), rows.stride(0), out.stride(0), BLOCK=block,
               ROWS=tile_rows, num_warps=warps)
    return out.reshape(x.shape)


def _backward_rows(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                   heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx`` (x's shape) and the fp32 ``[P, heads, H]`` token-sum partials (module docstring)."""
    hidden = x.shape[-1]
    rows, grads = rows_2d(x), rows_2d(grad)
    tokens = rows.shape[0] // heads
    block, tile_rows, warps = tile_for(hidden)
    padded = max(next_power_of_2(max(tokens, 1)), tile_rows)
    step = padded // tile_rows
    grad_x = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    partials = torch.empty((step, heads, hidden), dtype=torch.float32, device=x.device)
    launch(_rms_norm_bwd_kernel, (step, heads), grads, rows, weight.contiguous(), grad_x, partials, tokens, step,
           heads, hidden, float(hidden), float(eps), grads.stride(0), rows.stride(0), grad_x.stride(0),
           BLOCK=block, ROWS=tile_rows, LEVELS=tile_rows.bit_length() - 1, num_warps=warps)
    return grad_x.reshape(x.shape), partials


def _token_sums(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[heads, H]``: each (head, lane)'s halving sum over the ``P`` partials of ``[P, heads, H]``,
    rounded once to ``dtype`` in the same launch (the adds of
    :func:`tpinv.kernels.reference_norm.sum_over_tokens_per_head`, then ``.to(dtype)``)."""
    step, heads, hidden = partials.shape
    return halving_sum_cuda(partials.view(step, heads * hidden).t(), dtype).view(heads, hidden)


def rms_norm_backward_cuda(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` in ``x.dtype`` / ``weight.dtype``; see the module docstring."""
    check_rms_norm_backward_inputs(grad, x, weight, eps)
    if x.shape[-1] > MAX_HIDDEN:
        return rms_norm_backward(grad, x, weight, eps)
    grad_x, partials = _backward_rows(grad, x, weight, eps, 1)
    return grad_x, _token_sums(partials, weight.dtype)[0]


def rms_norm_backward_heads_cuda(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight per head [heads, H])`` for ``x [..., heads, H]``: one launch for all
    heads; head ``h``'s row has the bits :func:`rms_norm_backward_cuda` gives its slice."""
    check_rms_norm_backward_inputs(grad, x, weight, eps)
    check_per_head_inputs(x)
    if x.shape[-1] > MAX_HIDDEN:
        return rms_norm_backward_heads(grad, x, weight, eps)
    grad_x, partials = _backward_rows(grad, x, weight, eps, x.shape[-2])
    return grad_x, _token_sums(partials, weight.dtype)
