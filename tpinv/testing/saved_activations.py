"""Bytes a forward keeps for its backward: what activation recompute is meant to lower.

:func:`saved_activation_bytes` runs a forward under ``torch.autograd.graph.saved_tensors_hooks``
and adds up the distinct storages autograd saved for the backward, leaving out the parameters
(they are kept whatever happens).  A storage saved by several ops counts once.  Checkpointed
regions (``torch.utils.checkpoint`` or megatron-core's ``tensor_parallel.checkpoint``) save
their inputs through autograd too, so they are counted; what the region's ops would have
saved is not kept, and not counted.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

__all__ = ["saved_activation_bytes"]


def _key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, s.data_ptr(), s.nbytes())


def saved_activation_bytes(forward: Callable[[], torch.Tensor], parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct non-parameter storages saved for backward while ``forward()`` runs.

    ``forward`` returns the output; it (and the graph) is kept alive until the count is taken.
    """
    params = {_key(p) for p in parameters}
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = _key(t)
        if k not in params:
            seen[k] = k[2]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    total = sum(seen.values())
    del out
    return total
