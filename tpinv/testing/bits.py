"""Byte-level equality, the one check behind every invariance assert.

Two results are the same bits when their shapes, dtypes and raw bytes are equal.
``torch.equal`` is not that check: it says True for 0.0 vs -0.0, for NaN payloads it says
False, and it compares across dtypes.  :func:`assert_same_bits` compares the bytes and, when
they differ, names the first differing element and both values.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

__all__ = ["assert_same_bits", "assert_bits_differ", "bits", "same_bits"]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in row-major order, for any strides (``contiguous()`` keeps a size-1
    dim's stride, which ``view(torch.uint8)`` refuses, so the copy is made with row-major strides)."""
    flat = t.detach().to("cpu").reshape(-1)
    return torch.empty(flat.shape, dtype=flat.dtype).copy_(flat).view(torch.uint8)


def bits(t: torch.Tensor) -> str:
    """16 hex digits digesting ``t``'s dtype, shape and exact bytes."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"bits() expects a torch.Tensor, got {type(t).__name__}")
    data = _raw(t)
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(data.numpy().tobytes())
    return h.hexdigest()[:16]


def _check_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """Empty when ``a`` and ``b`` are the same bits, else where and how they differ."""
    if tuple(a.shape) != tuple(b.shape):
        return f"shapes differ: {list(a.shape)} vs {list(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtypes differ: {a.dtype} vs {b.dtype}"
    ra, rb = _raw(a), _raw(b)
    if torch.equal(ra, rb):
        return ""
    size = max(a.element_size(), 1)
    first_byte = int((ra != rb).nonzero()[0, 0])
    flat = first_byte // size
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(a.shape))) if a.dim() else ()
    va = a.detach().reshape(-1)[flat].item()
    vb = b.detach().reshape(-1)[flat].item()
    count = int((ra.view(-1, size) != rb.view(-1, size)).any(dim=1).sum()) if a.numel() else 0
    return (f"{count} of {a.numel()} elements differ; first at index {list(index)}: "
            f"{va!r} vs {vb!r}")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same shape, dtype and raw bytes."""
    return not _difference(_check_tensor(a, "a"), _check_tensor(b, "b"))


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "tensors") -> None:
    """Raise AssertionError unless ``a`` and ``b`` have the same shape, dtype and raw bytes;
    the message names ``what``, the first differing element and both values."""
    diff = _difference(_check_tensor(a, what), _check_tensor(b, what))
    if diff:
        raise AssertionError(f"{what} are not the same bits: {diff}")


def assert_bits_differ(a: torch.Tensor, b: torch.Tensor, what: str = "tensors") -> None:
    """The negative control's assert: ``a`` and ``b`` must differ in shape, dtype or bytes."""
    if not _difference(_check_tensor(a, what), _check_tensor(b, what)):
        raise AssertionError(f"{what} are the same bits: the control shows no difference, so the "
                             f"check beside it could not fail")
