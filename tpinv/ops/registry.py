"""Defining ``tpinv::`` custom ops: a CPU kernel now, a CUDA slot that never falls back.

Every op of the library is a :func:`torch.library.custom_op` in the ``tpinv``
namespace whose CPU kernel keeps the contract's fixed reduction order.  Its CUDA
slot holds a placeholder that raises :class:`NotImplementedError` naming the op
until an invariant GPU kernel is registered with :func:`register_cuda_kernel`, so
a CUDA tensor can never silently reach cuBLAS (or any order-changing fallback).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
try:
    from torch.library import CustomOpDef
except ImportError:                      # older torch keeps it private
    from torch._library.custom_ops import CustomOpDef

NAMESPACE = "tpinv"

#: CUDA kernel currently registered for each op, by qualified name.
_CUDA_KERNELS: dict[str, Callable] = {}


def qualified_name(name: str) -> str:
    """``"matmul"`` -> ``"tpinv::matmul"`` (a qualified name is returned unchanged)."""
    if "::" in name:
        namespace, _, short = name.partition("::")
        if namespace != NAMESPACE or not short:
            raise ValueError(f"op name {name!r} must be '{NAMESPACE}::<name>' or a bare <name>")
        return name
    if not name.isidentifier():
        raise ValueError(f"op name {name!r} must be a Python identifier such as 'matmul'")
    return f"{NAMESPACE}::{name}"


def missing_cuda_kernel(qualname: str) -> Callable:
    """The CUDA-slot placeholder of ``qualname``: raises instead of computing."""

    def no_cuda_kernel(*args, **kwargs):
        raise NotImplementedError(
            f"{qualname} has no CUDA kernel yet; register an invariant one with "
            f"tpinv.ops.registry.register_cuda_kernel (no cuBLAS fallback is used)")

    no_cuda_kernel.__qualname__ = no_cuda_kernel.__name__ = f"no_cuda_kernel[{qualname}]"
    no_cuda_kernel.is_placeholder = True
    return no_cuda_kernel


def define_op(name: str, *, mutates_args: Iterable[str] = ()) -> Callable[[Callable], CustomOpDef]:
    """Decorator: define ``tpinv::<name>`` with the decorated function as its CPU kernel.

    The schema comes from the function's type annotations.  The CUDA slot is filled
    with :func:`missing_cuda_kernel`; register a fake (``op.register_fake``) and, where
    the op is differentiable, autograd (``op.register_autograd``) on the result.
    """
    qualname = qualified_name(name)

    def wrap(cpu_kernel: Callable) -> CustomOpDef:
        op = torch.library.custom_op(qualname, mutates_args=tuple(mutates_args),
                                     device_types="cpu")(cpu_kernel)
        placeholder = missing_cuda_kernel(qualname)
        op.register_kernel("cuda", placeholder)
        _CUDA_KERNELS[qualname] = placeholder
        return op

    return wrap


def _qualname_of(op: CustomOpDef) -> str:
    if not isinstance(op, CustomOpDef):
        raise TypeError(f"expected a tpinv custom op (CustomOpDef), got {type(op).__name__}")
    qualname = op._qualname
    if qualname not in _CUDA_KERNELS:
        raise ValueError(f"{qualname} was not defined through tpinv.ops.registry.define_op")
    return qualname


def register_cuda_kernel(op: CustomOpDef, kernel: Callable) -> None:
    """Fill the CUDA slot of ``op`` with ``kernel`` (same signature as the CPU kernel)."""
    qualname = _qualname_of(op)
    op.register_kernel("cuda", kernel)
    _CUDA_KERNELS[qualname] = kernel


def cuda_kernel(op: CustomOpDef) -> Callable:
    """The function currently in the CUDA slot of ``op`` (the placeholder until filled)."""
    return _CUDA_KERNELS[_qualname_of(op)]


def has_cuda_kernel(op: CustomOpDef) -> bool:
    """Whether a real CUDA kernel (not the placeholder) is registered for ``op``."""
    return not getattr(cuda_kernel(op), "is_placeholder", False)
