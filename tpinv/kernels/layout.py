"""Output layouts: a kernel's output has the memory layout its fake kernel declares.

Invariant kept: an op whose fake kernel returns ``torch.empty_like(x)`` returns, on every
device, a tensor with exactly those strides (where they have a unit last stride) -- so a
graph traced with fake tensors sees the strides eager code gets, and a ``[B, S, H, D]``
buffer viewed as ``[B, H, S, D]`` comes back in that layout, making the caller's transpose
back a view instead of a copy.  Layout never changes a value: the kernels address their
outputs through strides, and :func:`in_layout_of` copies exactly.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["empty_in_layout_of", "in_layout_of"]


def empty_in_layout_of(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An uninitialized tensor of ``t``'s shape in ``t``'s memory layout -- ``torch.empty_like``,
    what the ops' fake kernels declare -- where that layout has a unit last stride, else
    contiguous.  A kernel writing through its output's strides then hands back the layout its
    input came in (``[B, S, H, D]`` memory seen as ``[B, H, S, D]``), so the caller's transpose back
    is a view, not a copy."""
    out = torch.empty_like(t, dtype=dtype)
    if out.dim() and out.shape[-1] > 1 and out.stride(-1) != 1:
        out = torch.empty(t.shape, dtype=out.dtype, device=t.device)
    return out


def in_layout_of(result: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``result`` (``t``'s shape) in :func:`empty_in_layout_of` ``(t)``'s layout: itself where the
    strides already agree, else an exact copy."""
    out = empty_in_layout_of(t, result.dtype)
    if out.stride() == result.stride():
        return result
    return out.copy_(result)
