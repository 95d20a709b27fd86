"""Host TMA descriptors kept for bound launches: per address, and their launcher expansions per
kernel parameter.

Invariant kept: a launch gets exactly the descriptor, and the launcher arguments, that building
them afresh would give.  A descriptor is a function of the address, shape, strides, dtype, block
and layout; a launch plan fixes all but the address, so :func:`reused_descriptor` keeps one per
address (for a bound launch only: :func:`tpinv.kernels.launch.is_bound`), whichever tensor is
there now.  Triton's ``make_tensordesc_arg`` turns a descriptor and a kernel parameter's metadata
into the launcher's arguments; :func:`expand_descriptors` keeps that expansion on the descriptor
per metadata, since one descriptor may fill several parameters (a stand-in for an unused one)
or serve several kernels.  Counters (:func:`descriptor_reuses`, :func:`descriptor_expansions`)
let tests assert that the kept ones are used.  Encoding a descriptor needs a CUDA context current
on the calling thread; :func:`on_cuda_context` gives one to a thread that has not called CUDA yet.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:          # Triton before 3.4: no host TMA descriptors (callers use pointer loads)
    TensorDescriptor = None

__all__ = ["TensorDescriptor", "reused_descriptor", "descriptor_reuses", "expand_descriptors",
           "descriptor_expansions", "expander", "on_cuda_context", "MAX_DESCRIPTORS"]


class _Address:
    """A reused descriptor's base: the tensor's address and dtype, no reference to the tensor
    (a bound launch reads only ``data_ptr()`` of it, so a kept descriptor keeps no memory alive)."""
    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


#: Descriptors a plan keeps per operand (by address) before it clears them and refills.
MAX_DESCRIPTORS = 256
_REUSED = [0]


def descriptor_reuses() -> int:
    """How many TMA descriptors so far were reused rather than built (tests assert it moves)."""
    return _REUSED[0]


def reused_descriptor(cache: Optional[dict], t: torch.Tensor, build):
    """``build()``, the TMA descriptor of ``t`` (or of a view of it at the same address), or
    with a ``cache`` (a launch plan's, for a bound launch only: :func:`tpinv.kernels.launch.is_bound`) the one built
    before at ``t``'s address.  A descriptor is a function of the address, shape, strides,
    dtype, block and layout, and the plan fixes all but the address, so a tensor at a cached
    address gets exactly the descriptor built for it, whichever tensor was there before."""
    if cache is None:
        return build()
    ptr = t.data_ptr()
    desc = cache.get(ptr)
    if desc is None:
        desc = build()
        desc.base = _Address(ptr, t.dtype)
        if len(cache) >= MAX_DESCRIPTORS:
            cache.clear()
        cache[ptr] = desc
    else:
        _REUSED[0] += 1
    return desc


def expand_descriptors(full: tuple, descriptors: tuple) -> list:
    """``full`` with each host TMA descriptor replaced by Triton's expansion of it, built once per
    descriptor object and kernel parameter's metadata and kept on the descriptor, per metadata: one
    descriptor may fill several parameters (a stand-in for an unused one) or serve several kernels."""
    out, start = [], 0
    for position, meta in descriptors:
        desc = full[position]
        kept_by_meta = getattr(desc, "_tpinv_expansions", None)
        if kept_by_meta is None:
            kept_by_meta = desc._tpinv_expansions = {}
        kept = kept_by_meta.get(id(meta))
        if kept is None or kept[0] is not meta:
            kept = kept_by_meta[id(meta)] = (meta, on_cuda_context(lambda: _EXPANDER[0](desc, meta)))
            _EXPANSIONS[0] += 1
        out.extend(full[start:position])
        out.extend(kept[1])
        start = position + 1
    out.extend(full[start:])
    return out


_EXPANSIONS = [0]


#: The driver's message for a call made with no CUDA context current (CUDA_ERROR_INVALID_CONTEXT).
_NO_CONTEXT = "invalid device context"


def on_cuda_context(call):
    """``call()``: something that encodes host TMA descriptors (Triton's ``make_tensordesc_arg``, or
    a first launch through Triton, which encodes them itself).  The encoder needs a CUDA context
    current on the calling thread, which a thread that has made no CUDA call yet lacks (a new worker
    thread; the autograd engine's device thread before its first kernel), and Triton's encoder does
    not set one up as its launcher does.  There the current device's primary context is made current
    -- as the thread's first CUDA call through torch would -- and ``call`` runs again: the failed
    attempt launched nothing.  Any other error is raised as it is."""
    try:
        return call()
    except RuntimeError as err:
        if (_NO_CONTEXT not in str(err) or not torch.cuda.is_available()
                or torch.cuda.is_current_stream_capturing()):
            raise
    torch.cuda.synchronize()   # a runtime call that needs a context: it makes the primary one current
    return call()


def descriptor_expansions() -> int:
    """How many host TMA descriptors so far were expanded for a launch (tests assert it stays put
    once a launch's descriptors are kept)."""
    return _EXPANSIONS[0]


def _tensordesc_expander():
    """Triton's ``make_tensordesc_arg(arg, metadata)`` (3.6's form), or None where it differs."""
    try:
        from triton.backends.nvidia import driver as nvidia_driver
        fn = nvidia_driver.make_tensordesc_arg
        if len(inspect.signature(fn).parameters) != 2 or nvidia_driver._BASE_ARGS_FORMAT_LEN != 13:
            return None
        return fn
    except Exception:        # any other Triton: its wrapper launches (same kernel, more host time)
        return None


_EXPANDER: list = []      # [Triton's make_tensordesc_arg, or None], resolved on first use


def expander():
    """Triton's ``make_tensordesc_arg`` where it has Triton 3.6's form, else None (resolved once)."""
    if not _EXPANDER:
        _EXPANDER.append(_tensordesc_expander())
    return _EXPANDER[0]
