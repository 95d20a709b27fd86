"""A held leaf's max pass (Gluon), for :mod:`tpinv.kernels.gluon_softmax`: its exact max and least element.

Invariant kept: the leaf's max is the row kernel's (:func:`tpinv.kernels.triton_softmax._fused`)
exact max of its elements -- NaN if any element is NaN, written as ``float("nan")``'s bits --
and, where no element is NaN, its least element (it only picks between instructions proven to
give the same bits: :func:`~tpinv.kernels.gluon_softmax_leaf.exp_never_flushes`; with a NaN the
row's shift is NaN and neither fast path is taken).
Both are order-free, so where each element is compared, and in which instruction, moves no
bit; ``tests/gpu/test_softmax_by_leaves.py`` compares the bytes, NaN of either sign, infinities,
signed zeros and subnormals included.

bf16 elements are compared as 16-bit integer keys (:func:`sortable_keys`: the magnitude bits
flipped where the sign is set, so that integer order is the values' order with ``-0 < +0``),
two to a register, in the integer min/max unit: an H200's bf16 min/max instructions made the
max pass of 16-bit statistics cost 12 points of copy bandwidth against fp16's 2
(docs/benchmarks.md, "The bf16 max pass compares integer keys").  Other dtypes compare in their
own type (fp16 two lanes an instruction).
"""
from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from tpinv.kernels.gluon_softmax_leaf import (leaf_tile, tile_holds_elements, tile_is_partial,
                                             widened)

__all__ = ["leaf_extremes", "sortable_keys"]

#: The least and greatest int16 keys: no bf16 key lies outside them.
_LEAST_KEY = gl.constexpr(-32768)
_GREATEST_KEY = gl.constexpr(32767)


@gluon.jit
def _max_and_min(a_max, a_min, b_max, b_min):
    return gl.maximum(a_max, b_max, propagate_nan=tl.PropagateNan.ALL), gl.minimum(a_min, b_min)


@gluon.jit
def _leaf_max_and_min(run, low):
    """The leaf's :func:`~tpinv.kernels.gluon_softmax_leaf.nan_max` from its running maxima (a
    maximum that keeps NaN, its NaN then written as ``float("nan")``'s bits) and the least of
    its running minima (NaN ignored), in one block reduction; both are order-free."""
    m, lo = gl.reduce((run, low), 0, _max_and_min)
    return gl.where(m != m, float("nan"), m), lo


@gluon.jit
def sortable_keys(x):
    """bf16 ``x`` (or int16 keys) as int16 keys in the values' order: the magnitude bits flipped
    where the sign is set (a byte permute spreads each half's sign over it; one logic operation
    flips), so ``-0`` sorts just below ``+0`` and a NaN beyond the infinity of its sign.  The
    map is its own inverse: keys give back the bf16 bits."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 m; prmt.b32 m, $1, 0, 0xBB99; and.b32 m, m, 0x7FFF7FFF; xor.b32 $0, $1, m; }",
        "=r,r", [x], dtype=gl.int16, is_pure=True, pack=2)


@gluon.jit
def _key_max(a, b):
    return gl.inline_asm_elementwise("max.s16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int16,
                                     is_pure=True, pack=2)


@gluon.jit
def _key_min(a, b):
    return gl.inline_asm_elementwise("min.s16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int16,
                                     is_pure=True, pack=2)


@gluon.jit
def _extended(run, low, x, inside, KEYS: gl.constexpr, MASKED: gl.constexpr):
    """``run`` and ``low`` (the running maxima and minima, keys where ``KEYS``) past the tile
    ``x``, its elements outside ``inside`` (``MASKED``: the leaf's last, partial tile) skipped."""
    if KEYS:
        key = sortable_keys(x)
        if MASKED:
            run = _key_max(run, gl.where(inside, key, _LEAST_KEY))
            low = _key_min(low, gl.where(inside, key, _GREATEST_KEY))
        else:
            run = _key_max(run, key)
            low = _key_min(low, key)
    else:
        if MASKED:
            run = gl.maximum(run, gl.where(inside, x, float("-inf")),
                             propagate_nan=tl.PropagateNan.ALL)
            low = gl.minimum(low, gl.where(inside, x, float("inf")))
        else:
            run = gl.maximum(run, x, propagate_nan=tl.PropagateNan.ALL)
            low = gl.minimum(low, x)
    return run, low


@gluon.jit
def leaf_extremes(a, b, c, x_leaf, tile_lanes, leaf_len, A: gl.constexpr, B: gl.constexpr,
                  BLOCK: gl.constexpr, TILE: gl.constexpr, STEPS: gl.constexpr,
                  LIVE: gl.constexpr, PARTIAL: gl.constexpr, HELD: gl.constexpr,
                  layout: gl.constexpr):
    """The leaf's exact max (:func:`_leaf_max_and_min`) and least element, in fp32, past the
    leaf's end no element (the tiles wholly past it are not read).  The leaf's copies are in
    flight, closed as one cp.async group a step (:func:`~tpinv.kernels.gluon_softmax._issue`):
    each step is read once its group has landed, so the pass starts with the leaf's first step,
    not its last (a thread reads the very elements it copied).  bf16 compares
    :func:`sortable_keys`: a positive NaN is then the greatest key and a negative one the least,
    so a thread whose least key is a NaN makes the max NaN; other dtypes compare in their own
    type."""
    KEYS: gl.constexpr = a.dtype == gl.bfloat16
    if KEYS:
        run = gl.full([TILE], _LEAST_KEY, gl.int16, layout)
        low = gl.full([TILE], _GREATEST_KEY, gl.int16, layout)
    else:
        run = gl.full([TILE], float("-inf"), a.dtype, layout)
        low = gl.full([TILE], float("inf"), a.dtype, layout)
    for k in gl.static_range(STEPS):
        async_copy.wait_group(STEPS - 1 - k)
        for t in gl.static_range(BLOCK // TILE):
            if tile_holds_elements(k, t, STEPS, LIVE):
                x = leaf_tile(a, b, c, x_leaf, k, t, A, B, BLOCK, TILE, tile_lanes, leaf_len,
                              layout, STEPS, LIVE, PARTIAL, HELD)
                inside = k * BLOCK + t * TILE + tile_lanes < leaf_len
                run, low = _extended(run, low, x, inside, KEYS,
                                     tile_is_partial(k, t, STEPS, LIVE, PARTIAL))
    if KEYS:
        run_f = widened(sortable_keys(run).to(gl.bfloat16, bitcast=True))
        low_f = widened(sortable_keys(low).to(gl.bfloat16, bitcast=True))
        run_f = gl.where(low_f != low_f, float("nan"), run_f)
    else:
        run_f = run.to(gl.float32)
        low_f = low.to(gl.float32)
    return _leaf_max_and_min(run_f, low_f)
