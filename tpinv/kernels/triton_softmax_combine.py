"""The held softmax statistics' combine: each row's total, and its logsumexp, from the leaf sums
the held launch published (:mod:`tpinv.kernels.gluon_softmax`, the statistics alone).

Invariant kept: the row kernel's total, the adjacent-pair tree of the leaf sums
(:func:`tpinv.kernels.triton_softmax._pair_tree`) over the fp32 bits each published word holds,
and its logsumexp, the fp32 operations of
:func:`tpinv.kernels.reference_softmax.logsumexp_from_parts` rounded once
(:func:`logsumexp_of`; the cluster kernel takes its rows' logsumexp with the same function).
``tests/unit/test_gluon_softmax_combine_interp.py`` (the interpreter) and
``tests/gpu/test_softmax_combine_cuda.py`` compare the bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpinv.kernels.launch import launch
from tpinv.kernels.triton_softmax import _pair_tree as _triton_pair_tree
from tpinv.kernels.triton_softmax import _shift_of as _triton_shift_of

__all__ = ["combine_sums", "logsumexp_of"]


@triton.jit
def _combine_sums(slot_ptr, total_ptr, max_ptr, lse_ptr, LEAVES: tl.constexpr,
                  LOG2_LEAVES: tl.constexpr, LSE: tl.constexpr):
    """Row ``program_id(0)``'s total from the leaf sums the statistics' launch published: their
    fp32 bits (the words' low halves) combined by the row kernel's adjacent-pair tree; with
    ``LSE``, also the row's logsumexp, ``safe_shift(max) + log(total)`` in fp32 rounded once to
    ``lse_ptr``'s dtype (:func:`logsumexp_of`)."""
    row = tl.program_id(0).to(tl.int64)
    words = tl.load(slot_ptr + row * (2 * LEAVES) + LEAVES + tl.arange(0, LEAVES))
    sums = (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    total = _triton_pair_tree(sums, LEAVES, LOG2_LEAVES)
    tl.store(total_ptr + row, total)
    if LSE:
        tl.store(lse_ptr + row, logsumexp_of(tl.load(max_ptr + row), total,
                                             lse_ptr.dtype.element_ty))


@triton.jit
def logsumexp_of(m, total, dtype: tl.constexpr):
    """``(safe_shift(m) + log(total)).to(dtype)``: the fp32 operations of
    :func:`tpinv.kernels.reference_softmax.logsumexp_from_parts`, rounded once (Triton's fp32
    ``log`` and casts give CUDA torch's bits for every fp32 input: checked over every fp32 bit
    pattern on an H200, and over every total a row can have in
    ``tests/gpu/test_softmax_by_leaves.py``)."""
    return (_triton_shift_of(m) + tl.log(total)).to(dtype)


def combine_sums(slots: torch.Tensor, max_: torch.Tensor, total: torch.Tensor, leaves: int,
                 lse: torch.Tensor | None) -> None:
    """Launch :func:`_combine_sums` over the statistics' published ``slots``: each row's
    ``total`` and, where ``lse`` is given, its logsumexp (``max_`` written by the launch before)."""
    launch(_combine_sums, (total.shape[0],), slots, total, max_, total if lse is None else lse,
           LEAVES=leaves, LOG2_LEAVES=leaves.bit_length() - 1, LSE=lse is not None,
           num_warps=1, enable_fp_fusion=False)
