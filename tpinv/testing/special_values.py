"""Rows of the values a softmax kernel's max, sum and output must treat exactly as the row
kernel does: NaN of either sign, infinities, -inf rows, -0 (alone, beside +0, at a leaf's end),
subnormals, all-negative leaves, values far from and near 0.

Invariant kept: only the rows named below change, each in the way its comment says, so a byte
comparison over them is a comparison of those cases (the GPU softmax tests and the softmax
benchmark's check use the same rows).
"""
from __future__ import annotations

import torch

__all__ = ["special_rows"]


#: The quiet NaN with its sign bit set, as an integer of each float's width (a float conversion
#: may drop a NaN's sign: torch's CPU bf16 rounding returns +NaN for every NaN).
_NEGATIVE_NAN = {torch.float32: (torch.int32, -0x400000), torch.bfloat16: (torch.int16, -0x40),
                 torch.float16: (torch.int16, -0x200)}


def _set_negative_nan(x: torch.Tensor, row: int, column: int) -> None:
    as_int, bits = _NEGATIVE_NAN[x.dtype]
    x.view(as_int)[row, column] = bits


def special_rows(x: torch.Tensor, leaves: int = 8) -> torch.Tensor:
    """A copy of the 2-D float ``x`` with its first rows made special (as many of the 17 cases
    as ``x`` has rows, at least 5); ``leaves``: the leaves a row is cut in, for the cases of one
    leaf."""
    if x.dim() != 2 or x.shape[0] < 5 or x.dtype not in _NEGATIVE_NAN:
        raise ValueError(f"special_rows needs a 2-D fp32, bf16 or fp16 tensor of 5 rows or more, got "
                         f"{tuple(x.shape)} {x.dtype}")
    x = x.clone()
    w = x.shape[1]
    x[0, 5] = float("nan")
    x[1] = float("-inf")
    x[2, w - 1] = float("inf")
    x[3, :] = -x[3].abs()            # a max of 0 reached with both signs
    x[3, 7] = 0.0
    x[3, w // 2 + 3] = -0.0
    x[4, w // 3] = float("-inf")
    if x.shape[0] > 8:   # the max pass's bf16 orders: NaN of either sign, -0, subnormals
        _set_negative_nan(x, 5, 11)
        x[6] = -x[6].abs() - 1.0     # a max of -0 alone
        x[6, 9] = -0.0
        x[6, w // 2] = -0.0
        x[7] = x[7] * (torch.finfo(x.dtype).tiny / 4)    # subnormal
        x[8, 3] = float("nan")
        _set_negative_nan(x, 8, 4)
    if x.shape[0] > 16:  # bf16's raw-bit maxima: leaves with no element of clear sign
        n = w // leaves  # one leaf
        x[9] = -x[9].abs() - 0.5                        # every leaf negative
        x[10, :n] = -0.0                                # a leaf of -0 alone
        x[11, :n] = float("-inf")                       # a leaf of -inf and one finite element
        x[11, n // 2] = -1000.0
        x[12, :n] = -x[12, :n].abs() - 3.0              # a negative NaN at a negative leaf's end
        _set_negative_nan(x, 12, n - 1)
        x[13] = x[13].abs() + 100.0                     # positive, far from 0
        x[14] = -x[14].abs()                            # -0 at the row's last element
        x[14, w - 1] = -0.0
        x[15] = -0.0                                    # -0 alone
        x[16] = x[16].abs() * 1e-3                      # positive, near 0
    return x
