"""What a process group argument means, decided in one place.

Every tpinv function that takes a tensor-parallel (or data-parallel) group passes it
through :func:`resolve_group` / :func:`group_size_rank`.  The one rule for ``None``:

- ``None`` means **a single rank** when torch.distributed is unavailable, not
  initialized, or initialized with a world of one process;
- ``None`` while torch.distributed runs with several ranks raises
  :class:`~tpinv.core.contract.InvarianceError`: tpinv never guesses a group.  A silent
  "the whole world" is how a TP x DP run reduces over the wrong ranks and breaks
  invariance, so the group is always passed explicitly (Megatron's convention in its
  ``tensor_parallel/mappings.py``).

To compute on this rank alone inside a multi-rank run (a row already gathered, a replicated
tensor, a TP=1 reference beside a TP=2 model), pass :data:`LOCAL`: an explicit group of one that
no collective ever touches.

An integration that has its own notion of a default group (megatron-core's
``parallel_state``) maps it to an explicit group before calling tpinv.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from tpinv.core.contract import InvarianceError

__all__ = ["LOCAL", "resolve_group", "group_size_rank", "group_size"]


class _Local:
    """The group of this rank alone (see :data:`LOCAL`)."""

    def __repr__(self) -> str:
        return "tpinv.distributed.groups.LOCAL"


#: An explicit single-rank group: size 1, rank 0, whatever torch.distributed runs.
LOCAL = _Local()


def _multi_rank_world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def resolve_group(group: Optional[dist.ProcessGroup], name: str = "tp_group") -> Optional[dist.ProcessGroup]:
    """``group`` itself, or ``None`` for a single-rank run; raises for ``None`` among several ranks.

    ``name`` is the argument's name in the error message.
    """
    if group is None and _multi_rank_world():
        raise InvarianceError(
            f"{name}=None while torch.distributed is initialized with {dist.get_world_size()} ranks: "
            f"pass the process group explicitly (tpinv never guesses a group)")
    return group


def group_size_rank(group: Optional[dist.ProcessGroup], name: str = "tp_group") -> tuple[int, int]:
    """``(size, rank)`` of ``group``; ``(1, 0)`` for ``None`` in a single-rank run (see the module rule)."""
    group = resolve_group(group, name)
    if group is None or group is LOCAL:
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process is not a member of the process group passed as {name}")
    return dist.get_world_size(group), rank


def group_size(group: Optional[dist.ProcessGroup], name: str = "tp_group") -> int:
    """The size of ``group``; 1 for ``None`` in a single-rank run (see the module rule)."""
    return group_size_rank(group, name)[0]
