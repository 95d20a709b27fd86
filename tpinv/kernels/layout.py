"""Output layouts: a kernel's output has the memory layout its fake kernel declares.

Invariant kept: an output declared like input ``x`` has, on every device and in the fake kernel
alike, the strides :func:`layout_strides` gives for ``x`` (``x``'s own where ``x`` is dense with a
unit last stride, as ``torch.empty_like`` keeps them) -- so a graph traced with fake tensors sees
the strides eager code gets, and a ``[B, S, H, D]``
buffer viewed as ``[B, H, S, D]`` comes back in that layout, making the caller's transpose
back a view instead of a copy.  Layout never changes a value: the kernels address their
outputs through strides, and :func:`in_layout_of` copies exactly.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["layout_strides", "empty_in_layout_of", "in_layout_of"]


def layout_strides(t: torch.Tensor) -> tuple:
    """The strides of the declared layout of an output shaped like ``t``: ``t``'s own where ``t``
    is dense (a permutation of a contiguous layout, as ``torch.empty_like`` keeps it) with a unit
    last stride, else contiguous.  A function of ``t``'s shape and strides only, computed without
    allocating, so the fake and the real output are put in it alike."""
    shape, strides = tuple(t.shape), t.stride()
    if not shape or shape[-1] == 1 or strides[-1] == 1:
        expected = 1
        for d in sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: strides[d]):
            if strides[d] != expected:
                break
            expected *= shape[d]
        else:
            return strides
    contiguous, step = [], 1
    for size in reversed(shape):
        contiguous.append(step)
        step *= max(size, 1)
    return tuple(reversed(contiguous))


def empty_in_layout_of(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An uninitialized tensor of ``t``'s shape in :func:`layout_strides` ``(t)``.  A kernel writing
    through its output's strides then hands back the layout its input came in (``[B, S, H, D]``
    memory seen as ``[B, H, S, D]``), so the caller's transpose back is a view, not a copy."""
    return torch.empty_strided(t.shape, layout_strides(t), dtype=dtype or t.dtype, device=t.device)


def in_layout_of(result: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``result`` (``t``'s shape) in :func:`layout_strides` ``(t)``: itself where its strides are
    those already (no allocation), else an exact copy."""
    if result.stride() == layout_strides(t):
        return result
    return empty_in_layout_of(t, result.dtype).copy_(result)
