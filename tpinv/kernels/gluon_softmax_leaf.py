"""A held leaf's arithmetic (Gluon), for :mod:`tpinv.kernels.gluon_softmax`: the row kernel's steps.

Invariant kept: each function here gives the bits of the same step of
:func:`tpinv.kernels.triton_softmax._fused` (the one-program-per-row kernel, whose order is the
contract) on one leaf held in shared memory: the exact max (NaN if any element is NaN), the
``BLOCK`` fp32 lanes of the leaf's sum (lane ``i`` adding ``exp(x - shift)`` of elements
``i, i + BLOCK, ...`` in order from ``+0``), their fold by contiguous halving (lane ``i`` plus lane
``i + n/2``), the adjacent-pair tree over a row's leaf sums, and softmax's correctly rounded
quotient ``div_rn(exp(x - shift), s)``.  Where these differ from the row kernel it is in where an
operation runs (which thread, after which exchange), or in which instructions compute it when the
result is provably the same (:func:`exp_shifted`, :func:`quotient_by_reciprocal`), never in an
operation's operands or order.  ``tests/gpu/test_softmax_by_leaves.py`` compares the bytes.
"""
from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

__all__ = ["nan_max", "shift_of", "leaf_max_and_min", "exp_shifted",
           "exp_never_flushes", "quotient_by_reciprocal", "reciprocal_divides_exactly",
           "leaf_sum", "fold_lanes", "pair_tree", "held_step", "held_step_fp32", "fold_layout_of",
           "in_thread_levels"]

#: log2(e), as Triton's exp multiplies by it (an fp32 operand rounds it to fp32).
_LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def nan_max(v):
    """The exact max of a 1-D ``v`` (order-free), NaN if any element is NaN, as ``torch.amax``."""
    return gl.where(gl.max(gl.where(v != v, 1, 0), axis=0) > 0, float("nan"), gl.max(v, axis=0))


@gluon.jit
def shift_of(m):
    """``safe_shift``: the max where finite, else 0 (NaN stays NaN)."""
    return gl.where(gl.abs(m) == float("inf"), 0.0, m)


@gluon.jit
def _max_and_min(a_max, a_min, b_max, b_min):
    return gl.maximum(a_max, b_max, propagate_nan=tl.PropagateNan.ALL), gl.minimum(a_min, b_min)


@gluon.jit
def leaf_max_and_min(run, low):
    """The leaf's :func:`nan_max` from its running maxima (a maximum that keeps NaN, its NaN
    then written as ``float("nan")``'s bits) and the least of its running minima (NaN ignored),
    in one block reduction; both are order-free."""
    m, lo = gl.reduce((run, low), 0, _max_and_min)
    return gl.where(m != m, float("nan"), m), lo


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
    """Whether every ``exp(x - shift)`` of a leaf whose least element is ``lo`` is the hardware ex2
    alone (:func:`exp_shifted`'s ``FLUSH_FREE``): ``(x - shift) * log2(e)`` rounds monotonically
    in ``x``, so where the least element's product is -126 or more, every element's is (a NaN
    ``lo`` or ``shift`` gives False)."""
    return _least_product(lo, shift) >= -126.0


@gluon.jit
def _least_product(lo, shift):
    """``(lo - shift) * log2(e)``: the ex2 argument of a leaf's least element ``lo``, no greater
    than any other element's (each rounding is monotonic)."""
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
    ``x`` of a leaf whose least element is ``lo`` (``exp`` the hardware ex2 alone there, as
    :func:`exp_never_flushes`): ``total`` in ``[1, 2**24)``, of exponent ``t``, and the least
    product ``(lo - shift) * log2(e)`` at least ``t - 96``.  Then every ``exp`` is above
    ``2**(t - 97)`` and every quotient above ``2**-98``, so each remainder ``a - b * q`` is a
    multiple of ``ulp(b) * ulp(q) >= 2**-144`` (no underflow: the theorem's condition), and no
    ``exp`` flushes.  NaN, infinities and an empty row give False (the general path runs)."""
    t = ((total.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return ((total >= 1.0) & (total < 16777216.0)
            & (_least_product(lo, shift) >= (t - 96).to(gl.float32)))


@gluon.jit
def leaf_sum(a, b, c, shift, lanes, leaf_len, A: gl.constexpr, B: gl.constexpr,
             BLOCK: gl.constexpr, STEPS: gl.constexpr, lanes_layout: gl.constexpr,
             FLUSH_FREE: gl.constexpr):
    """The row kernel's lanes: lane ``i`` adds ``exp(x - shift)`` of the leaf's elements
    ``i, i + BLOCK, ...`` in order from ``+0`` (each thread reads back the elements it copied, so
    no barrier is needed after the max pass)."""
    acc = gl.zeros([BLOCK], gl.float32, lanes_layout)
    for k in gl.static_range(STEPS):
        x = held_step_fp32(a, b, c, k, A, B, BLOCK, lanes, leaf_len, lanes_layout, STEPS)
        acc += exp_shifted(x - shift, FLUSH_FREE)
    return acc


@gluon.jit
def fold_lanes(acc, BLOCK: gl.constexpr, LOG2_BLOCK: gl.constexpr, IN_THREAD: gl.constexpr,
               fold_layout: gl.constexpr):
    """``[BLOCK] -> scalar`` by contiguous halving: lane ``i`` plus lane ``i + n/2``, repeated.
    The first ``IN_THREAD`` levels pair lanes one thread holds; the rest run after one exchange
    through shared memory into ``fold_layout`` (:func:`fold_layout_of`), where every warp holds
    all the remaining lanes, so their levels are a thread's own adds and warp shuffles -- the same
    adds in the same order, without a block barrier a level."""
    for i in gl.static_range(IN_THREAD):
        acc = gl.sum(gl.reshape(acc, [2, BLOCK >> (i + 1)]), axis=0)
    acc = gl.convert_layout(acc, fold_layout)
    for i in gl.static_range(IN_THREAD, LOG2_BLOCK):
        acc = gl.sum(gl.reshape(acc, [2, BLOCK >> (i + 1)]), axis=0)
    return gl.sum(acc, axis=0)


@gluon.jit
def pair_tree(v, N: gl.constexpr, LOG2_N: gl.constexpr, layout: gl.constexpr):
    """The adjacent-pair tree ``((v0+v1)+(v2+v3))+...`` of ``tree_combine``."""
    for i in gl.static_range(LOG2_N):
        pairs = gl.reshape(gl.convert_layout(v, layout), [N >> (i + 1), 2])
        v = gl.sum(pairs, axis=1)
    return gl.sum(v, axis=0)


@gluon.jit
def held_step(a, b, c, k: gl.constexpr, A: gl.constexpr, B: gl.constexpr, BLOCK: gl.constexpr):
    """Step ``k`` of the held leaf: steps ``[0, A)`` live in ``a``, ``[A, A + B)`` in ``b``, the
    rest in ``c`` (shared-memory shapes are powers of two, so a leaf of, say, 5 steps is 4 + 1)."""
    if k < A:
        return a.slice(k * BLOCK, BLOCK)
    elif k < A + B:
        return b.slice((k - A) * BLOCK, BLOCK)
    else:
        return c.slice((k - A - B) * BLOCK, BLOCK)


@gluon.jit
def held_step_fp32(a, b, c, k: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
                   BLOCK: gl.constexpr, lanes, leaf_len, layout: gl.constexpr,
                   STEPS: gl.constexpr):
    """Step ``k`` of the held leaf in fp32, ``-inf`` past the leaf's end (the row kernel's
    masked load; only the last step can reach past it)."""
    x = held_step(a, b, c, k, A, B, BLOCK).load(layout).to(gl.float32)
    if k == STEPS - 1:
        x = gl.where(k * BLOCK + lanes < leaf_len, x, float("-inf"))
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


def in_thread_levels(block: int, vec: int, num_warps: int) -> int:
    """The fold's first levels whose pairs one thread holds in the row layout (``vec`` contiguous
    lanes a thread, ``32 * num_warps`` threads)."""
    return max(0, block.bit_length() - (vec * 32 * num_warps).bit_length())
