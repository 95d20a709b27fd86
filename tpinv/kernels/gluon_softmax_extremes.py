"""A held leaf's max pass (Gluon) for :mod:`tpinv.kernels.gluon_softmax`: its exact max, a floor.

Invariant kept: the leaf's max is the row kernel's (:func:`tpinv.kernels.triton_softmax._fused`)
exact max of its elements -- NaN if any element is NaN, written as ``float("nan")``'s bits, and
``+0`` above ``-0`` -- and, where no element is NaN, a floor: a value no element is below (it
only picks between instructions proven to give the same bits:
:func:`~tpinv.kernels.gluon_softmax_leaf.exp_never_flushes`, where a lower floor only takes the
general path more often; with a NaN the row's shift is NaN and neither fast path is taken).
Both are order-free, so where each element is compared, and in which instruction, moves no
bit; ``tests/gpu/test_softmax_by_leaves.py`` compares the bytes, NaN of either sign, infinities,
signed zeros, subnormals and leaves with no element of clear sign included.

bf16 elements are compared as their raw bits, two a register, in the integer min/max unit
(:func:`leaf_extremes`): an H200's bf16 min/max instructions made the max pass of 16-bit
statistics cost 12 points of copy bandwidth against fp16's 2 (docs/benchmarks.md, "The bf16 max
pass compares integer keys"), and two raw maxima a pair, which the assembler folds two pairs an
instruction, cost less than keys made from the bits first ("The bf16 max pass compares raw
bits").  Other dtypes compare in their own type (fp16 two lanes an instruction).
"""
from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from tpinv.kernels.gluon_softmax_leaf import (leaf_tile, tile_holds_elements, tile_is_partial,
                                             widened)

__all__ = ["leaf_extremes"]

#: ``-0``'s bits as an int16: the least signed value, and an unsigned value no negative element
#: is below -- where both maxima start, and what a lane past the leaf's end takes in them
#: (:func:`leaf_extremes`).
_NEGATIVE_ZERO = gl.constexpr(-32768)
#: The greatest unsigned 16-bit value (a NaN's bits): the start of an unsigned minimum.
_ALL_ONES = gl.constexpr(-1)


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
def _signed_max(a, b):
    return gl.inline_asm_elementwise("max.s16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int16,
                                     is_pure=True, pack=2)


@gluon.jit
def _unsigned_max(a, b):
    return gl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int16,
                                     is_pure=True, pack=2)


@gluon.jit
def _unsigned_min(a, b):
    return gl.inline_asm_elementwise("min.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int16,
                                     is_pure=True, pack=2)


@gluon.jit
def _float_extended(run, low, x, inside, MASKED: gl.constexpr):
    """``run`` and ``low`` (running maxima and minima in ``x``'s type) past the tile ``x``, its
    elements outside ``inside`` (``MASKED``: the leaf's last, partial tile) skipped."""
    if MASKED:
        run = gl.maximum(run, gl.where(inside, x, float("-inf")),
                         propagate_nan=tl.PropagateNan.ALL)
        low = gl.minimum(low, gl.where(inside, x, float("inf")))
    else:
        run = gl.maximum(run, x, propagate_nan=tl.PropagateNan.ALL)
        low = gl.minimum(low, x)
    return run, low


@gluon.jit
def _bits(a, b, c, x_leaf, k: gl.constexpr, t: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
          BLOCK: gl.constexpr, TILE: gl.constexpr, tile_lanes, leaf_len, layout: gl.constexpr,
          STEPS: gl.constexpr, LIVE: gl.constexpr, PARTIAL: gl.constexpr, HELD: gl.constexpr,
          PAST_END: gl.constexpr):
    """Tile ``t`` of step ``k`` of a bf16 leaf as its raw bits (int16), ``PAST_END`` past the
    leaf's end."""
    raw = leaf_tile(a, b, c, x_leaf, k, t, A, B, BLOCK, TILE, tile_lanes, leaf_len, layout, STEPS,
                    LIVE, PARTIAL, HELD).to(gl.int16, bitcast=True)
    if tile_is_partial(k, t, STEPS, LIVE, PARTIAL):
        raw = gl.where(k * BLOCK + t * TILE + tile_lanes < leaf_len, raw, PAST_END)
    return raw


@gluon.jit
def _least_magnitude(a, b, c, x_leaf, tile_lanes, leaf_len, A: gl.constexpr, B: gl.constexpr,
                     BLOCK: gl.constexpr, TILE: gl.constexpr, STEPS: gl.constexpr,
                     LIVE: gl.constexpr, PARTIAL: gl.constexpr, HELD: gl.constexpr,
                     layout: gl.constexpr):
    """The max of a bf16 leaf every element of which has its sign bit set and none is NaN: its
    element of least magnitude, the least of its bits as unsigned integers (``-0`` the least)."""
    least = gl.full([TILE], _ALL_ONES, gl.int16, layout)
    for k in gl.static_range(STEPS):
        for t in gl.static_range(BLOCK // TILE):
            if tile_holds_elements(k, t, STEPS, LIVE):
                least = _unsigned_min(least, _bits(a, b, c, x_leaf, k, t, A, B, BLOCK, TILE,
                                                   tile_lanes, leaf_len, layout, STEPS, LIVE,
                                                   PARTIAL, HELD, _ALL_ONES))
    least_f = widened(least.to(gl.bfloat16, bitcast=True))
    return gl.max(gl.where(tile_lanes < leaf_len, least_f, float("-inf")), axis=0)


@gluon.jit
def leaf_extremes(a, b, c, x_leaf, tile_lanes, leaf_len, A: gl.constexpr, B: gl.constexpr,
                  BLOCK: gl.constexpr, TILE: gl.constexpr, STEPS: gl.constexpr,
                  LIVE: gl.constexpr, PARTIAL: gl.constexpr, HELD: gl.constexpr,
                  layout: gl.constexpr):
    """``(max, floor)`` of the leaf in fp32 (:func:`_leaf_max_and_min`; past the leaf's end no
    element, the tiles wholly past it not read).  The leaf's copies are in flight, closed as one
    cp.async group a step (:func:`~tpinv.kernels.gluon_softmax._issue`): each step is read once
    its group has landed, so the pass starts with the leaf's first step, not its last (a thread
    reads the very elements it copied).

    bf16 takes two maxima of each lane's raw bits, a pair a register: signed, whose result is
    the lane's greatest element of clear sign (a positive NaN above +inf) where it has one, and
    unsigned, whose result is its element of set sign of greatest magnitude (the least; a
    negative NaN above -inf) where it has one.  The leaf's max is then the greatest of the
    former; a negative NaN makes it NaN; the floor is the least of the latter, ``-0`` for lanes
    with no element of set sign (no element there is below it).  Where no element of the leaf has a clear sign, a second pass
    takes its element of least magnitude (:func:`_least_magnitude`).  Other dtypes compare in
    their own type."""
    RAW: gl.constexpr = a.dtype == gl.bfloat16
    if RAW:
        run = gl.full([TILE], _NEGATIVE_ZERO, gl.int16, layout)
        neg = gl.full([TILE], _NEGATIVE_ZERO, gl.int16, layout)
    else:
        run = gl.full([TILE], float("-inf"), a.dtype, layout)
        neg = gl.full([TILE], float("inf"), a.dtype, layout)
    for k in gl.static_range(STEPS):
        async_copy.wait_group(STEPS - 1 - k)
        for t in gl.static_range(BLOCK // TILE):
            if tile_holds_elements(k, t, STEPS, LIVE):
                if RAW:
                    raw = _bits(a, b, c, x_leaf, k, t, A, B, BLOCK, TILE, tile_lanes, leaf_len,
                                layout, STEPS, LIVE, PARTIAL, HELD, _NEGATIVE_ZERO)
                    run = _signed_max(run, raw)
                    neg = _unsigned_max(neg, raw)
                else:
                    x = leaf_tile(a, b, c, x_leaf, k, t, A, B, BLOCK, TILE, tile_lanes, leaf_len,
                                  layout, STEPS, LIVE, PARTIAL, HELD)
                    run, neg = _float_extended(run, neg, x,
                                               k * BLOCK + t * TILE + tile_lanes < leaf_len,
                                               tile_is_partial(k, t, STEPS, LIVE, PARTIAL))
    if RAW:
        # a lane's max where it holds an element of clear sign (int16 >= 0), else -inf; its
        # floor the unsigned maximum as it stands, which starts at -0's bits: -0 where the lane
        # holds no element of set sign; a negative NaN (its floor NaN) makes the lane's max NaN
        run_f = gl.where(run >= 0, widened(run.to(gl.bfloat16, bitcast=True)), float("-inf"))
        low_f = widened(neg.to(gl.bfloat16, bitcast=True))
        m, lo = _leaf_max_and_min(gl.where(low_f != low_f, float("nan"), run_f), low_f)
        if m == float("-inf"):   # no element of clear sign, no NaN
            m = _least_magnitude(a, b, c, x_leaf, tile_lanes, leaf_len, A, B, BLOCK, TILE, STEPS,
                                 LIVE, PARTIAL, HELD, layout)
    else:
        m, lo = _leaf_max_and_min(run.to(gl.float32), neg.to(gl.float32))
    return m, lo
