"""TMA descriptors for the attention kernels: the same tiles as the pointer loads, so the same bits.

A descriptor copies a box of a tensor into shared memory and fills zeros where the box runs past
the tensor's shape, exactly the zeros the masked pointer loads put past ``T``, past ``S`` and past
the head dim.  The kernels take a descriptor wherever one can read the tensor (a 16-bit dtype,
16-byte aligned address and strides, Triton 3.4+, on a GPU or in Triton's interpreter) and
pointer loads elsewhere; either way a tile holds the same values, the dots the same operands,
and the tests (GPU and interpreter) hold both paths to the same bytes.  Two readings:

* K/V blocks of ``[B, Hkv, T, D]``: boxes ``[1, 1, KB, DP]`` (:func:`kv_descriptors`);
* the interleaved query rows ``r = s * g + hg`` of one kv head: ``x`` ``[B, Hq, S, D]`` read as
  ``[B, S, Hkv, g, D]`` in boxes ``[1, rows / g, 1, g, DP]``, whose row-major order is the
  rows' (:func:`row_descriptor`); any strides, so ``[B, S, H, D]``-laid-out projections too.

A launch planned per call signature (:func:`attention_plan`: shapes, strides, dtypes, alignment
and settings) keeps its bound launcher and, once bound, each operand's descriptors per address
(:func:`tpinv.kernels.descriptors.reused_descriptor`; ``kept=`` below): a descriptor is a
function of the address and what the plan fixes, so a kept one is the one a build would give.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tpinv.kernels.descriptors import TensorDescriptor, reused_descriptor
from tpinv.kernels.launch import is_bound, remember

__all__ = ["descriptor", "kv_descriptors", "row_descriptor", "load_kv_tma", "attention_plan", "kept_for"]


def descriptor(t: torch.Tensor, shape: list, strides: list, block: list, kept: Optional[dict] = None):
    """A TMA descriptor reading ``t`` as ``shape``/``strides`` (elements) in ``block`` tiles, or
    ``None`` where none can (no host descriptors in this Triton, not a 16-bit dtype, an address,
    a stride or the last dim not 16-byte aligned).  A dim of size 1 is never stepped, so its
    stride is replaced by an aligned one.  ``kept``: a plan's descriptors of this operand by
    address (:func:`kept_for`), used and filled.  Triton's interpreter reads descriptors too (CPU
    tensors), so the CPU tests run this path."""
    if TensorDescriptor is None or t.element_size() != 2:
        return None
    if strides[-1] != 1 or t.data_ptr() % 16 or shape[-1] % 8:
        return None
    strides = [st if n > 1 else 8 for n, st in zip(shape, strides)]
    if any(st <= 0 or st % 8 for st in strides[:-1]):
        return None
    return reused_descriptor(kept, t, lambda: TensorDescriptor(t, list(shape), strides, list(block)))


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, KB: int, DP: int, kept: Optional[dict] = None):
    """TMA descriptors of ``k`` and ``v`` ``[B, Hkv, T, D]`` with ``[1, 1, KB, DP]`` blocks, or
    ``None`` (:func:`descriptor`).  Either way the kernels get the same tiles: the copy fills
    zeros past ``T`` and ``D`` as the masked loads do.  ``kept``: :func:`kept_for`'s dict."""
    kd = descriptor(k, list(k.shape), list(k.stride()), [1, 1, KB, DP], _operand(kept, ("k", KB)))
    vd = descriptor(v, list(v.shape), list(v.stride()), [1, 1, KB, DP], _operand(kept, ("v", KB)))
    return None if kd is None or vd is None else (kd, vd)


def row_descriptor(x: torch.Tensor, g: int, rows: int, DP: int, kept: Optional[dict] = None, name: str = "x"):
    """A TMA descriptor of ``x`` ``[B, Hq, S, D]`` read as ``[B, S, Hkv, g, D]`` in blocks of
    ``[1, rows / g, 1, g, DP]``: a row tile of the interleaved rows ``r = s * g + hg`` of one kv
    head, in that order (zeros past ``S`` and ``D``); ``None`` (:func:`descriptor`, or ``g`` not
    a power of two dividing ``rows``).  ``kept``: :func:`kept_for`'s dict; ``name`` tells the
    plan's operands apart (a descriptor is kept per operand name and row tile)."""
    if g & (g - 1) or rows % g:
        return None
    B, Hq, S, D = x.shape
    sb, sh, ss, sd = x.stride()
    return descriptor(x, [B, S, Hq // g, g, D], [sb, ss, sh * g, sh, sd], [1, rows // g, 1, g, DP],
                      _operand(kept, (name, rows)))


_PLANS: dict = {}    # call signature -> {kernel or operand name: bound launchers / kept descriptors}


def attention_plan(key) -> dict:
    """The launch plan of an attention call signature ``key``: everything a launch's integer
    arguments, constexprs, tensor dtypes and alignment follow from (the operands'
    :func:`~tpinv.kernels.launch.operands_key` and the call's settings).  A dict that holds, per
    kernel, its bound launchers (``launch(..., bound=plan.setdefault(name, {}))``) and, per
    operand, its descriptors by address (:func:`kept_for`)."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = remember(_PLANS, key, {})
    return plan


def kept_for(plan: dict, bound: dict) -> Optional[dict]:
    """``plan`` as the store of kept descriptors where the launch bound in ``bound`` reads them
    (a bound launch passes descriptors to the compiled kernel; a first launch through Triton gets
    descriptors of the real tensors), else None (build them)."""
    return plan if is_bound(bound) else None


def _operand(kept: Optional[dict], name: tuple) -> Optional[dict]:
    if kept is None:
        return None
    table = kept.get(name)
    if table is None:
        table = kept[name] = {}
    return table


@triton.jit
def load_kv_tma(k_desc, v_desc, b, hk, blk, KB: tl.constexpr, DP: tl.constexpr):
    """``(slots, K, V)`` of key block ``blk`` through TMA descriptors over ``[B, Hkv, T, D]``: the
    same tiles as :func:`~tpinv.kernels.triton_attention_tiles.load_kv_blocks` (the copy fills
    zeros past ``T`` and ``D``)."""
    slots = blk * KB + tl.arange(0, KB)
    k = k_desc.load([b, hk, blk * KB, 0]).reshape(KB, DP)
    v = v_desc.load([b, hk, blk * KB, 0]).reshape(KB, DP)
    return slots, k, v
