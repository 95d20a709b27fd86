"""How the tree collectives meet torch.distributed: the cross-rank call check and the transport guard.

Invariant: the ranks of a group that enter one of tpinv's collectives
(:mod:`tpinv.distributed.reduce`) either agree on the call -- op, shape, dtype, algorithm, leaves,
dim -- or every one of them raises the same :class:`InvarianceError`, naming each rank's call;
none hangs in a collective its peers never reach.  A failure of the transport itself (a peer
exited, broke its connection, timed out) is raised as :class:`CollectiveError` naming the op.

The check (:func:`check_agree`) all-gathers a small fixed-length descriptor of the call.
Reading the gathered descriptors makes the host wait for the device, so by default (``check=True``,
mode ``"first"``) a rank checks each call signature on a group once, the first time it makes it,
and trusts it afterwards: the steady state of a training or decode loop pays no check.
``check="always"``, or ``TPINV_CHECK_COLLECTIVES=always`` in the environment, checks every call
(for debugging a rank that diverges only on a signature it has used before).  Inside a CUDA-graph
capture the check stands aside (the warm-up's eager calls checked those shapes); under
torch.compile it is a ``torch._assert_async`` node of the graph, on every call.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Iterator

import torch
import torch.distributed as dist

from tpinv.core.capture import capturing, compiling
from tpinv.core.contract import InvarianceError
from tpinv.core.dtypes import NAMES

__all__ = ["CHECK_MODES", "CHECK_ENV", "VERIFIED_MAX", "CollectiveError", "all_gather_single",
           "check_agree", "check_mode", "collective_errors"]

#: The ``check`` values: True is ``"first"`` (each call signature once per rank and group; see the
#: module docstring), unless ``TPINV_CHECK_COLLECTIVES=always``; False skips the check.
CHECK_MODES = ("first", "always")
CHECK_ENV = "TPINV_CHECK_COLLECTIVES"
#: Verified signatures kept per group before the set starts over (every rank of a group that
#: agrees makes the same calls, so every rank starts over at the same call).
VERIFIED_MAX = 4096

_OPS = ("tree_all_reduce", "tree_reduce_scatter", "all_gather")   # the collectives checked
_DTYPES = tuple(NAMES.values())  # descriptor codes: a dtype's index in tpinv's one name table
_DESC_DIMS = 10

_VERIFIED: dict = {}             # group -> the descriptors verified on it
_VERIFIED_WORLD: list = [None]   # the default group those groups belong to


class CollectiveError(RuntimeError):
    """A collective of the tree reducer failed (a peer exited, hung, or the transport broke)."""


@contextlib.contextmanager
def collective_errors(op: str, algorithm: str, size: int, rank: int) -> Iterator[None]:
    """Raise a transport failure inside the block as :class:`CollectiveError` naming the call."""
    try:
        yield
    except RuntimeError as exc:
        raise CollectiveError(
            f"{op} (algorithm={algorithm!r}) over a group of {size} ranks failed on group "
            f"rank {rank}: a peer rank exited, broke its connection or did not reach the same "
            f"collective within the process-group timeout. Cause: {exc}") from exc


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """Rank-order concatenation of the contiguous ``inp`` into the contiguous ``out``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(-1), inp.reshape(-1), group=group)


def check_mode(check: bool | str) -> str | None:
    """``"first"``, ``"always"`` or None (no check) for a collective's ``check`` argument."""
    if check is True:
        return "always" if os.environ.get(CHECK_ENV, "").strip().lower() == "always" else "first"
    if check is False:
        return None
    if check not in CHECK_MODES:
        raise ValueError(f"check={check!r}: expected True, False or one of {CHECK_MODES}")
    return check


def _verified(group) -> set:
    world = dist.group.WORLD
    if _VERIFIED_WORLD[0] is not world:   # a new default group: its groups are new too
        _VERIFIED.clear()
        _VERIFIED_WORLD[0] = world
    return _VERIFIED.setdefault(group, set())


def _describe(row: list[int], algorithms: tuple[str, ...]) -> str:
    op, algo, leaves, dcode, dim, ndim = row[:6]
    dtype = _DTYPES[dcode] if dcode < len(_DTYPES) else "other"
    shape = tuple(row[6:6 + min(ndim, _DESC_DIMS)]) + (("...",) if ndim > _DESC_DIMS else ())
    return (f"{_OPS[op]}(shape={shape}, dtype={dtype}, dim={dim}, algorithm={algorithms[algo]}, "
            f"leaves={leaves})")


def check_agree(op: str, t: torch.Tensor, group, size: int, rank: int, *, algorithm: str,
                algorithms: tuple[str, ...], leaves: int, dim: int, mode: str = "always") -> None:
    """All-gather a small descriptor of the call; raise the same InvarianceError on every rank on
    a mismatch.

    ``algorithms`` names every ``algorithm`` a rank may pass (its index is the descriptor's code).
    ``mode="first"`` skips a descriptor this rank has verified on ``group`` before.  Not inside
    a CUDA-graph capture (it reads the gathered descriptors on the host): a captured step
    replays the shapes its eager warm-up runs checked.  Under torch.compile the comparison is a
    ``torch._assert_async`` node of the graph (``RuntimeError`` naming the op), every call."""
    if capturing():
        return
    shape = list(t.shape)
    if len(shape) > _DESC_DIMS:  # fold the tail so the descriptor keeps a fixed length
        shape = shape[:_DESC_DIMS - 1] + [math.prod(shape[_DESC_DIMS - 1:])]
    shape += [0] * (_DESC_DIMS - len(shape))
    dtype = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)
    desc = [_OPS.index(op), algorithms.index(algorithm), leaves, dtype, dim, t.dim()] + shape
    seen = None
    if mode == "first" and not compiling():
        seen = _verified(group)
        if tuple(desc) in seen:
            return
    mine = torch.tensor(desc, dtype=torch.int64, device=t.device)
    every = torch.empty(size * mine.numel(), dtype=torch.int64, device=t.device)
    with collective_errors(f"{op} descriptor check", algorithm, size, rank):
        all_gather_single(every, mine, group)
    if compiling():  # no host read inside a graph: the same comparison, asserted in the graph
        table = every.view(size, -1)
        torch._assert_async((table == table[0]).all(), f"ranks disagree on {op}; every rank must pass the "
                            f"same shape, dtype and settings (checked inside the compiled graph)")
        return
    rows = every.view(size, -1).tolist()
    if any(r != rows[0] for r in rows):
        lines = "\n".join(f"  group rank {i}: {_describe(r, algorithms)}" for i, r in enumerate(rows))
        raise InvarianceError(f"ranks disagree on {op}; every rank must pass the same shape, "
                              f"dtype and settings:\n{lines}")
    if seen is not None:
        if len(seen) >= VERIFIED_MAX:
            seen.clear()
        seen.add(tuple(desc))
