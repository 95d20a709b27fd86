"""A held leaf's arithmetic (Gluon), for :mod:`tpinv.kernels.gluon_softmax`: the row kernel's steps.

Invariant kept: each function here gives the bits of the same step of
:func:`tpinv.kernels.triton_softmax._fused` (the one-program-per-row kernel, whose order is the
contract) on one leaf held in shared memory: the exact max of the leaf maxima (NaN if any is
NaN; the leaf's own max pass is :mod:`tpinv.kernels.gluon_softmax_extremes`), the
``BLOCK`` fp32 lanes of the leaf's sum (lane ``i`` adding ``exp(x - shift)`` of elements
``i, i + BLOCK, ...`` in order from ``+0``), their fold by contiguous halving (lane ``i`` plus lane
``i + n/2``), the adjacent-pair tree over a row's leaf sums, and softmax's correctly rounded
quotient ``div_rn(exp(x - shift), s)``.  Where these differ from the row kernel it is in where an
operation runs (which thread, after which exchange), or in which instructions compute it when the
result is provably the same (:func:`exp_shifted`, :func:`quotient_by_reciprocal`), never in an
operation's operands or order.  ``tests/gpu/test_softmax_by_leaves.py`` compares the bytes.
"""
from __future__ import annotations

from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tpinv.kernels.launch import cdiv

__all__ = ["widened", "nan_max", "shift_of", "exp_shifted",
           "exp_never_flushes", "quotient_by_reciprocal", "reciprocal_divides_exactly",
           "leaf_sum", "fold_lanes", "pair_tree", "held_tile",
           "held_tile_fp32", "leaf_tile", "tile_holds_elements", "tile_is_partial",
           "tile_in_memory", "fold_layout_of",
           "tile_lanes_of", "live_tiles"]

#: log2(e), as Triton's exp multiplies by it (an fp32 operand rounds it to fp32).
_LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def widened(x):
    """``x.to(float32)``'s bits.  A bf16 is the high 16 bits of the fp32 of the same value (NaN
    payloads and subnormals included), so a pair of them held in one 32-bit register widens by
    two bit operations, the low one shifted up and the high one masked, where the compiler's
    conversion takes three (it moves the high half down, then shifts it back up)."""
    if x.dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }",
                                         "=r,=r,r", [x], dtype=gl.float32, is_pure=True, pack=2)
    else:
        return x.to(gl.float32)


@gluon.jit
def nan_max(v):
    """The exact max of a 1-D ``v`` (order-free), NaN if any element is NaN, as ``torch.amax``."""
    return gl.where(gl.max(gl.where(v != v, 1, 0), axis=0) > 0, float("nan"), gl.max(v, axis=0))


@gluon.jit
def shift_of(m):
    """``safe_shift``: the max where finite, else 0 (NaN stays NaN)."""
    return gl.where(gl.abs(m) == float("inf"), 0.0, m)


@gluon.jit
def exp_shifted(d, FLUSH_FREE: gl.constexpr):
    """``gl.exp(d)``'s bits.  Triton's fp32 exp is ``ex2.approx.f32(d * log2(e))``, which the
    assembler writes as the hardware ex2 alone where the product is -126 or more (or NaN), and
    elsewhere as: halve the product, ex2, square the result (so that results under 2**-126 are
    not flushed to zero) -- a compare and two predicated multiplies on every element.  With
    ``FLUSH_FREE`` the caller knows every product is -126 or more, and ``ex2.approx.ftz.f32``,
    the hardware ex2 alone, gives the same bits in one instruction."""
    if FLUSH_FREE:
        return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [d * _LOG2E],
                                         dtype=gl.float32, is_pure=True, pack=1)
    else:
        return gl.exp(d)


@gluon.jit
def exp_never_flushes(lo, shift):
    """Whether every ``exp(x - shift)`` of a leaf no element of which is below ``lo`` is the
    hardware ex2 alone (:func:`exp_shifted`'s ``FLUSH_FREE``): ``(x - shift) * log2(e)`` rounds
    monotonically in ``x``, so where the product at ``lo`` is -126 or more, every element's is
    (a NaN ``lo`` or ``shift`` gives False)."""
    return _least_product(lo, shift) >= -126.0


@gluon.jit
def _least_product(lo, shift):
    """``(lo - shift) * log2(e)``: the ex2 argument at a leaf's floor ``lo``, no greater than any
    element's (each rounding is monotonic)."""
    return (lo - shift) * _LOG2E


@gluon.jit
def quotient_by_reciprocal(a, b, y):
    """``div_rn(a, b)``'s bits from ``y = div_rn(1, b)``, taken once a row: ``q = a * y``, then
    two corrections ``q + (a - b * q) * y``, each one fused multiply-add for the exact remainder
    and one for the step (five instructions an element, against ``div_rn``'s reciprocal, its
    refinement, its corrections and its range check).  After the first correction ``q`` is
    within one ulp of ``a / b`` (its error is the remainder times ``y - 1/b``, under 2**-22 ulp,
    plus one rounding); from such a ``q`` and ``y`` within half an ulp of ``1/b``, the second
    correction rounds to the correctly rounded quotient (Markstein's theorem; P. Markstein, IBM
    J. Res. Dev. 34(1), 1990; Muller et al., *Handbook of Floating-Point Arithmetic*, 2018,
    section 4.7.3) -- where nothing underflows: :func:`reciprocal_divides_exactly` says where."""
    q = a * y
    q = gl.fma(gl.fma(-b, q, a), y, q)
    return gl.fma(gl.fma(-b, q, a), y, q)


@gluon.jit
def reciprocal_divides_exactly(lo, shift, total):
    """Whether :func:`quotient_by_reciprocal` gives ``div_rn(exp(x - shift), total)`` for every
    ``x`` of a leaf no element of which is below ``lo`` (``exp`` the hardware ex2 alone there, as
    :func:`exp_never_flushes`): ``total`` in ``[1, 2**24)``, of exponent ``t``, and the least
    product ``(lo - shift) * log2(e)`` at least ``t - 96``.  Then every ``exp`` is above
    ``2**(t - 97)`` and every quotient above ``2**-98``, so each remainder ``a - b * q`` is a
    multiple of ``ulp(b) * ulp(q) >= 2**-144`` (no underflow: the theorem's condition), and no
    ``exp`` flushes.  NaN, infinities and an empty row give False (the general path runs)."""
    t = ((total.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return ((total >= 1.0) & (total < 16777216.0)
            & (_least_product(lo, shift) >= (t - 96).to(gl.float32)))


@gluon.jit
def _tile_sum(a, b, c, x_leaf, t: gl.constexpr, shift, tile_lanes, leaf_len, A: gl.constexpr,
              B: gl.constexpr, BLOCK: gl.constexpr, TILE: gl.constexpr, STEPS: gl.constexpr,
              LIVE: gl.constexpr, PARTIAL: gl.constexpr, HELD: gl.constexpr,
              layout: gl.constexpr, FLUSH_FREE: gl.constexpr, KEEP_EXP: gl.constexpr):
    """The lanes of tile ``t`` (lanes ``t * TILE ...``): lane ``i`` adds ``exp(x - shift)`` of
    the leaf's elements ``i, i + BLOCK, ...`` in order from ``+0``, skipping the last step where
    the tile lies past the leaf's end (the row kernel adds ``exp(-inf) = +0`` there, which leaves
    every sum as it is)."""
    acc = gl.zeros([TILE], gl.float32, layout)
    if KEEP_EXP:
        acc = _steps_keeping_exp(a, b, c, x_leaf, t, 0, acc, shift, tile_lanes, leaf_len, A, B,
                                 BLOCK, TILE, STEPS, LIVE, PARTIAL, HELD, layout, FLUSH_FREE)
    else:
        for k in gl.static_range(STEPS):
            if tile_holds_elements(k, t, STEPS, LIVE):
                x = held_tile_fp32(a, b, c, x_leaf, k, t, A, B, BLOCK, TILE, tile_lanes,
                                   leaf_len, layout, STEPS, LIVE, PARTIAL, HELD)
                acc += exp_shifted(x - shift, FLUSH_FREE)
    return acc


@gluon.jit
def _steps_keeping_exp(a, b, c, x_leaf, t: gl.constexpr, k: gl.constexpr, acc, shift,
                       tile_lanes, leaf_len, A: gl.constexpr, B: gl.constexpr,
                       BLOCK: gl.constexpr, TILE: gl.constexpr, STEPS: gl.constexpr,
                       LIVE: gl.constexpr, PARTIAL: gl.constexpr, HELD: gl.constexpr,
                       layout: gl.constexpr, FLUSH_FREE: gl.constexpr):
    """:func:`_tile_sum`'s steps ``k, k + 1, ...`` of tile ``t``, each ``exp`` then written over
    its element: every step is read (and added, in order) before any is written, so the
    compiler's shared-memory barrier falls once a tile, not once a step (each thread writes only
    what it read, but the compiler orders every read of a region before a write to it)."""
    if tile_holds_elements(k, t, STEPS, LIVE):
        x = held_tile_fp32(a, b, c, x_leaf, k, t, A, B, BLOCK, TILE, tile_lanes, leaf_len,
                           layout, STEPS, LIVE, PARTIAL, HELD)
        e = exp_shifted(x - shift, FLUSH_FREE)
        acc = _steps_keeping_exp(a, b, c, x_leaf, t, k + 1, acc + e, shift, tile_lanes, leaf_len,
                                 A, B, BLOCK, TILE, STEPS, LIVE, PARTIAL, HELD, layout,
                                 FLUSH_FREE)
        if not tile_in_memory(k, t, STEPS, HELD):   # a tile read from memory keeps no exps
            held_tile(a, b, c, k, t, A, B, BLOCK, TILE).store(e)
    return acc


@gluon.jit
def leaf_sum(a, b, c, x_leaf, shift, tile_lanes, leaf_len, A: gl.constexpr, B: gl.constexpr,
             BLOCK: gl.constexpr, TILE: gl.constexpr, STEPS: gl.constexpr, LIVE: gl.constexpr,
             PARTIAL: gl.constexpr, HELD: gl.constexpr, layout: gl.constexpr,
             FLUSH_FREE: gl.constexpr, KEEP_EXP: gl.constexpr, FIRST: gl.constexpr = 0,
             STRIDE: gl.constexpr = 1):
    """The row kernel's ``BLOCK`` lanes of the leaf's sum (:func:`_tile_sum`, a tile of them at a
    time), folded by contiguous halving down to one tile: lane ``i`` plus lane ``i + n/2`` while
    the pair lies in one thread (tiles ``t`` and ``t + n/2``), i.e. the fold's first
    ``log2(BLOCK / TILE)`` levels, written as the tree they make (tiles ``FIRST, FIRST + STRIDE,
    ...``: its even ones folded, plus its odd ones folded).  Each thread reads back the elements
    it copied, so no barrier is needed after the max pass.  With ``KEEP_EXP`` (an fp32 leaf)
    each ``exp`` replaces its element in the leaf, for softmax's quotients to read back."""
    if STRIDE * TILE == BLOCK:
        lanes = _tile_sum(a, b, c, x_leaf, FIRST, shift, tile_lanes, leaf_len, A, B, BLOCK, TILE,
                          STEPS, LIVE, PARTIAL, HELD, layout, FLUSH_FREE, KEEP_EXP)
    else:
        lanes = (leaf_sum(a, b, c, x_leaf, shift, tile_lanes, leaf_len, A, B, BLOCK, TILE, STEPS,
                          LIVE, PARTIAL, HELD, layout, FLUSH_FREE, KEEP_EXP, FIRST, 2 * STRIDE)
                 + leaf_sum(a, b, c, x_leaf, shift, tile_lanes, leaf_len, A, B, BLOCK, TILE,
                            STEPS, LIVE, PARTIAL, HELD, layout, FLUSH_FREE, KEEP_EXP,
                            FIRST + STRIDE, 2 * STRIDE))
    return lanes


@gluon.jit
def fold_lanes(acc, TILE: gl.constexpr, LOG2_TILE: gl.constexpr, fold_layout: gl.constexpr):
    """``[TILE] -> scalar`` by contiguous halving (lane ``i`` plus lane ``i + n/2``, repeated),
    the rest of :func:`leaf_sum`'s fold: one exchange through shared memory into ``fold_layout``
    (:func:`fold_layout_of`), where every warp holds all the lanes, so each level is a thread's
    own adds or warp shuffles -- the same adds in the same order, without a block barrier a
    level."""
    acc = gl.convert_layout(acc, fold_layout)
    for i in gl.static_range(LOG2_TILE):
        acc = gl.sum(gl.reshape(acc, [2, TILE >> (i + 1)]), axis=0)
    return gl.sum(acc, axis=0)


@gluon.jit
def pair_tree(v, N: gl.constexpr, LOG2_N: gl.constexpr, layout: gl.constexpr):
    """The adjacent-pair tree ``((v0+v1)+(v2+v3))+...`` of ``tree_combine``."""
    for i in gl.static_range(LOG2_N):
        pairs = gl.reshape(gl.convert_layout(v, layout), [N >> (i + 1), 2])
        v = gl.sum(pairs, axis=1)
    return gl.sum(v, axis=0)


@constexpr_function
def tile_holds_elements(k, t, STEPS, LIVE):
    """Whether tile ``t`` of step ``k`` holds any of the leaf's elements: every tile of the steps
    before the last, and the last step's first ``LIVE``."""
    return k < STEPS - 1 or (k == STEPS - 1 and t < LIVE)


@constexpr_function
def tile_is_partial(k, t, STEPS, LIVE, PARTIAL):
    """Whether tile ``t`` of step ``k`` reaches past the leaf's end (the last step's last live
    tile, where the leaf's end falls inside it): the one tile read or written under a mask."""
    return k == STEPS - 1 and t == LIVE - 1 and PARTIAL


@constexpr_function
def tile_in_memory(k, t, STEPS, HELD):
    """Whether tile ``t`` of step ``k`` is read from global memory in every pass rather than held:
    the last step's tiles from ``HELD`` on (``HELD`` = every live tile where the whole leaf fits
    its program's share of shared memory:
    :func:`~tpinv.kernels.gluon_softmax_plan.held_buffers`)."""
    return k == STEPS - 1 and t >= HELD


@gluon.jit
def held_tile(a, b, c, k: gl.constexpr, t: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
              BLOCK: gl.constexpr, TILE: gl.constexpr):
    """Tile ``t`` of step ``k`` of the held leaf: the ``TILE`` lanes one tile of the row layout
    spans (each thread copies, and later reads, the same elements of it).  Steps ``[0, A)`` live
    in ``a``, ``[A, A + B)`` in ``b``, the rest in ``c`` (shared-memory shapes are powers of two,
    so a leaf of, say, 5 steps is 4 + 1; ``c`` may hold only the last step's first tiles:
    :func:`tile_in_memory`)."""
    if k < A:
        return a.slice(k * BLOCK + t * TILE, TILE)
    elif k < A + B:
        return b.slice((k - A) * BLOCK + t * TILE, TILE)
    else:
        return c.slice((k - A - B) * BLOCK + t * TILE, TILE)


@gluon.jit
def leaf_tile(a, b, c, x_leaf, k: gl.constexpr, t: gl.constexpr, A: gl.constexpr,
              B: gl.constexpr, BLOCK: gl.constexpr, TILE: gl.constexpr, tile_lanes, leaf_len,
              layout: gl.constexpr, STEPS: gl.constexpr, LIVE: gl.constexpr,
              PARTIAL: gl.constexpr, HELD: gl.constexpr):
    """Tile ``t`` of step ``k`` in the input's dtype: from shared memory where it is held, else
    (:func:`tile_in_memory`) from the leaf ``x_leaf`` in global memory (past the leaf's end:
    0, which callers mask as the held tile's copy there)."""
    if tile_in_memory(k, t, STEPS, HELD):
        offs = k * BLOCK + t * TILE + tile_lanes
        if tile_is_partial(k, t, STEPS, LIVE, PARTIAL):
            x = gl.load(x_leaf + offs, mask=offs < leaf_len, other=0.0)
        else:
            x = gl.load(x_leaf + offs)
    else:
        x = held_tile(a, b, c, k, t, A, B, BLOCK, TILE).load(layout)
    return x


@gluon.jit
def held_tile_fp32(a, b, c, x_leaf, k: gl.constexpr, t: gl.constexpr, A: gl.constexpr,
                   B: gl.constexpr, BLOCK: gl.constexpr, TILE: gl.constexpr, tile_lanes,
                   leaf_len, layout: gl.constexpr, STEPS: gl.constexpr, LIVE: gl.constexpr,
                   PARTIAL: gl.constexpr, HELD: gl.constexpr):
    """Tile ``t`` of step ``k`` (:func:`leaf_tile`) in fp32, ``-inf`` past the leaf's end (the
    row kernel's masked load; only the last live tile of the last step can reach past it)."""
    x = widened(leaf_tile(a, b, c, x_leaf, k, t, A, B, BLOCK, TILE, tile_lanes, leaf_len, layout,
                          STEPS, LIVE, PARTIAL, HELD))
    if tile_is_partial(k, t, STEPS, LIVE, PARTIAL):
        x = gl.where(k * BLOCK + t * TILE + tile_lanes < leaf_len, x, float("-inf"))
    return x


def fold_layout_of(lanes: int, num_warps: int) -> gl.DistributedLinearLayout:
    """The layout :func:`fold_lanes` folds its last ``lanes`` (a power of two) in: lane ``l`` is
    lanes ``4 * l .. 4 * l + 3`` of every ``128`` (four contiguous in one thread: one vector
    load), the rows of 128 in the thread's registers, every warp holding all of them (so each
    level pairs a thread's own values or, at the ``4 .. 64`` distances, two lanes of a warp)."""
    bits = lanes.bit_length() - 1
    low, mid = min(2, bits), min(5, max(0, bits - 2))
    regs = [[1 << b] for b in range(low)] + [[1 << b] for b in range(7, bits)]
    thread = [[1 << b] for b in range(2, 2 + mid)] + [[0]] * (5 - mid)
    return gl.DistributedLinearLayout(regs, thread, [[0]] * (num_warps.bit_length() - 1), [],
                                      [lanes])


def tile_lanes_of(vec: int, num_warps: int, block: int) -> int:
    """The lanes one tile of the row layout spans (``vec`` contiguous lanes a thread,
    ``32 * num_warps`` threads), at most ``block``."""
    return min(block, vec * 32 * num_warps)


def live_tiles(leaf_len: int, block: int, tile: int) -> tuple[int, bool]:
    """``(tiles of the last step that hold elements, whether the last of them is partial)``."""
    last = leaf_len - (cdiv(leaf_len, block) - 1) * block
    return cdiv(last, tile), last % tile != 0
