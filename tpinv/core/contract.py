"""The invariance contract in code.

Every reduction over a dimension that some parallelism may split is computed as:
cut the dimension into ``L`` equal contiguous leaves, reduce each leaf with a fixed
chain (backend-defined), combine the ``L`` fp32 leaf results with the balanced
adjacent-pair tree ``((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))``, round once.

A rank of a group of size ``C`` (``C`` divides ``L``) owns leaves
``[r*L/C, (r+1)*L/C)``; the tree over all leaves equals the tree over the ``C``
rank sub-trees, so the result has the same bits at every ``C``.  This module
holds the constants, the validation every layer calls, and the tree itself.
"""
from __future__ import annotations

import torch

from tpinv.core.dtypes import MODEL_DTYPES

#: Default number of leaves (the largest TP size the run must agree with).
TP_MAX = 8
DEFAULT_LEAVES = TP_MAX

#: Input dtypes the invariant ops accept (tpinv.core.dtypes.MODEL_DTYPES).  Accumulation is always fp32.
SUPPORTED_DTYPES = MODEL_DTYPES


class InvarianceError(ValueError):
    """A setting that would break the invariance contract."""


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


def check_leaves(leaves: int) -> int:
    """Validate a leaf count: a power of two."""
    if not is_power_of_two(leaves):
        raise InvarianceError(
            f"leaves={leaves!r} must be a positive power of two (1, 2, 4, 8, ...); "
            f"use the TP_MAX of the run, default {DEFAULT_LEAVES}")
    return leaves


def check_tp_size(tp_size: int, leaves: int = DEFAULT_LEAVES) -> int:
    """A TP (or any reducing group) size must be a power of two dividing ``leaves``."""
    check_leaves(leaves)
    if not is_power_of_two(tp_size):
        raise InvarianceError(
            f"group size {tp_size} is not a power of two; tpinv needs 1, 2, 4, ... up to "
            f"leaves={leaves} so every rank owns whole sub-trees of the leaf tree")
    if leaves % tp_size:
        raise InvarianceError(
            f"group size {tp_size} does not divide leaves={leaves}; raise leaves (TP_MAX) "
            f"to at least {tp_size} in every engine that must agree, or use a smaller group")
    return tp_size


def check_divisible(name: str, size: int, parts: int, what: str = "leaves") -> int:
    """``size`` must split into ``parts`` equal pieces; returns the piece length."""
    if size % parts:
        raise InvarianceError(
            f"{name}={size} is not divisible by {what}={parts}; pick {name} as a multiple of "
            f"{parts} (e.g. {size + (-size) % parts}) or change {what}")
    return size // parts


def check_dtype(dtype: torch.dtype, name: str = "input") -> torch.dtype:
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise InvarianceError(f"{name} dtype {dtype} is not supported; use one of {names}")
    return dtype


def leaf_bounds(size: int, leaves: int = DEFAULT_LEAVES) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of each leaf of a dimension of length ``size``."""
    n = check_divisible("size", size, check_leaves(leaves))
    return [(i * n, (i + 1) * n) for i in range(leaves)]


def rank_leaves(rank: int, group_size: int, leaves: int = DEFAULT_LEAVES) -> range:
    """The leaf indices owned by ``rank`` in a group of ``group_size``."""
    check_tp_size(group_size, leaves)
    if not 0 <= rank < group_size:
        raise InvarianceError(f"rank {rank} is outside a group of size {group_size}")
    per = leaves // group_size
    return range(rank * per, (rank + 1) * per)


def tree_combine(parts: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Combine a power-of-two number of fp32 partials along ``dim`` with the adjacent-pair tree.

    ``((p0+p1)+(p2+p3))+...``: the top of the leaf tree.  Each step is one exact
    elementwise IEEE add per element, so the bits do not depend on shape, layout or
    thread count.  ``a+b == b+a`` bitwise, so only the tree's shape matters.
    """
    n = parts.shape[dim]
    if not is_power_of_two(n):
        raise InvarianceError(f"tree_combine needs a power-of-two count of partials, got {n}")
    if parts.dtype != torch.float32:
        raise InvarianceError(f"partials travel and combine in fp32, got {parts.dtype}")
    x = parts.movedim(dim, -1)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x.squeeze(-1)


def tree_combine_list(parts: list[torch.Tensor]) -> torch.Tensor:
    """:func:`tree_combine` over a list of same-shaped fp32 tensors (rank order)."""
    if not is_power_of_two(len(parts)):
        raise InvarianceError(f"tree_combine needs a power-of-two count of partials, got {len(parts)}")
    level = list(parts)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


class TreeAccumulator:
    """Adds pushed fp32 tensors with the adjacent-pair tree in push order (zero-padded to a power of two):
    :func:`tree_combine_list` of the pushed tensors, without holding them all.

    A binary counter: equal-sized subtrees merge as soon as both exist, so at most
    ``log2(n) + 1`` partial sums are held.  The result is ``((t0+t1)+(t2+t3))+...``.
    """

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []

    def push(self, t: torch.Tensor) -> None:
        level = 0
        while self._stack and self._stack[-1][0] == level:
            left = self._stack.pop()[1]
            t, level = left + t, level + 1
        self._stack.append((level, t))

    def result(self) -> torch.Tensor:
        if not self._stack:
            raise ValueError("TreeAccumulator.result() before any push")
        acc = self._stack[-1][1]
        for _, left in reversed(self._stack[:-1]):  # missing right subtrees are zeros: x + 0 == x
            acc = left + acc
        return acc
