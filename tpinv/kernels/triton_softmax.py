"""The softmax family on CUDA (Triton): the leaf contract over the last dim, fixed order.

Order fixed: the last dim (a vocabulary tensor parallelism may split) is cut into
``leaves`` equal contiguous leaves; one program per (row, leaf) sums ``exp(x - m)`` over
its leaf in a fixed order -- a vector accumulator of ``BLOCK`` lanes walks the leaf in
``BLOCK``-wide steps from the leaf's start (lanes past the leaf's end add ``exp(-inf) = 0``),
then one ``tl.sum`` over the lanes -- with ``BLOCK`` a function of the leaf length only.  The
fp32 leaf sums are combined by :func:`tpinv.contract.tree_combine`.  A leaf's sum therefore
depends on its own elements and ``m`` alone: not on the row count, other rows, padding rows,
or how many leaves the caller's slice holds, so ``C`` slices each given ``leaves // C``
combine (``tree_combine`` in rank order) to the unsplit bits.

``m`` is the exact row max (``torch.amax``); a row whose max is infinite is shifted by 0.
``log_softmax = (x - m) - log(s)`` and ``softmax = exp(x - m) / s`` (correctly rounded
division) are elementwise per element, rounded once to ``x.dtype``.  Semantics are those of
:mod:`tpinv.kernels.cpu_softmax`; bits may differ from the CPU kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpinv.contract import tree_combine
from tpinv.kernels.cpu_softmax import (check_partial_inputs, check_softmax_inputs,
                                       logsumexp_from_parts, safe_shift)

__all__ = ["sum_exp_partial_cuda", "softmax_forward_cuda", "log_softmax_forward_cuda",
           "logsumexp_forward_cuda", "leaf_block"]

_MAX_LEAF_BLOCK = 4096
_OUT_BLOCK = 4096


def leaf_block(leaf_len: int) -> int:
    """Accumulator width for a leaf of ``leaf_len`` elements (leaf length only)."""
    return max(16, min(_MAX_LEAF_BLOCK, triton.next_power_of_2(max(leaf_len, 1))))


@triton.jit
def _leaf_sum_exp_kernel(x_ptr, shift_ptr, out_ptr, leaf_len, stride_x, n_leaves,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    leaf = tl.program_id(1)
    shift = tl.load(shift_ptr + row)
    base = x_ptr + row * stride_x + leaf.to(tl.int64) * leaf_len
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, leaf_len, BLOCK):
        ok = (start + offs) < leaf_len
        x = tl.load(base + start + offs, mask=ok, other=float("-inf")).to(tl.float32)
        acc += tl.exp(x - shift)
    tl.store(out_ptr + row * n_leaves + leaf, tl.sum(acc, axis=0))


@triton.jit
def _softmax_out_kernel(x_ptr, shift_ptr, total_ptr, y_ptr, width, stride_x, stride_y,
                        LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    shift = tl.load(shift_ptr + row)
    total = tl.load(total_ptr + row)
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    shifted = x - shift
    if LOG:
        y = shifted - tl.log(total)
    else:
        y = tl.math.div_rn(tl.exp(shifted), total)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _sum_exp_rows(rows: torch.Tensor, shift: torch.Tensor, leaves: int) -> torch.Tensor:
    """fp32 ``[M]``: tree of the ``leaves`` leaf sums of ``exp(rows - shift)``."""
    n_rows, width = rows.shape
    leaf_len = width // leaves
    partials = torch.empty((n_rows, leaves), dtype=torch.float32, device=rows.device)
    if n_rows:
        block = leaf_block(leaf_len)
        _leaf_sum_exp_kernel[(n_rows, leaves)](rows, shift, partials, leaf_len, rows.stride(0),
                                               leaves, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return tree_combine(partials)


def sum_exp_partial_cuda(x: torch.Tensor, max_: torch.Tensor, leaves: int) -> torch.Tensor:
    """fp32 sub-tree of ``exp(x - max)`` over this slice's ``leaves`` leaves, ``x.shape[:-1]``."""
    check_partial_inputs(x, max_, leaves)
    shift = safe_shift(max_).reshape(-1).contiguous()
    return _sum_exp_rows(_rows(x), shift, leaves).reshape(x.shape[:-1])


def _max_and_sum(rows: torch.Tensor, leaves: int) -> tuple[torch.Tensor, torch.Tensor]:
    max_ = torch.amax(rows, dim=-1).to(torch.float32)
    return max_, _sum_exp_rows(rows, safe_shift(max_).contiguous(), leaves)


def _from_parts(x: torch.Tensor, leaves: int, log: bool) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        max_, total = _max_and_sum(rows, leaves)
        shift = safe_shift(max_).contiguous()
        grid = (rows.shape[0], triton.cdiv(rows.shape[1], _OUT_BLOCK))
        _softmax_out_kernel[grid](rows, shift, total, out, rows.shape[1], rows.stride(0),
                                  out.stride(0), LOG=log, BLOCK=_OUT_BLOCK, num_warps=8)
    return out.reshape(x.shape)


def softmax_forward_cuda(x: torch.Tensor, leaves: int) -> torch.Tensor:
    """``exp(x - m) / s`` over the last dim, rounded once to ``x.dtype``."""
    check_softmax_inputs(x, leaves, "softmax")
    return _from_parts(x, leaves, log=False)


def log_softmax_forward_cuda(x: torch.Tensor, leaves: int) -> torch.Tensor:
    """``(x - m) - log(s)`` over the last dim, rounded once to ``x.dtype``."""
    check_softmax_inputs(x, leaves, "log_softmax")
    return _from_parts(x, leaves, log=True)


def logsumexp_forward_cuda(x: torch.Tensor, leaves: int) -> torch.Tensor:
    """``m + log(s)`` over the last dim (``x.shape[:-1]``), rounded once to ``x.dtype``."""
    check_softmax_inputs(x, leaves, "logsumexp")
    rows = _rows(x)
    max_, total = _max_and_sum(rows, leaves)
    return logsumexp_from_parts(max_, total).to(x.dtype).reshape(x.shape[:-1])
