"""Activation recompute with Megatron's names and meanings, computing the same bits as without it.

Invariant kept: a model run with recompute gives the same losses, the same gradient bits and so
the same weights as without it.  Recompute only changes *when* a piece of the forward runs (once
with gradients off, again during backward); every tpinv op has a fixed reduction order, so the
second run recomputes the first run's bits, and the backward then sees the tensors it would have
saved.  Anything random in the forward must also repeat: :func:`checkpointed` restores torch's
CPU and device RNG states before the second run (tpinv's own dropout masks are functions of their
indices, drawing from no generator).

Settings (megatron-core ``TransformerConfig`` fields of the same names):

* ``recompute_granularity="selective"``: the attention core (softmax(q k^T) v, the
  :func:`tpinv.ops.attention` call) of every layer is recomputed; ``recompute_method`` and
  ``recompute_num_layers`` must be None.
* ``recompute_granularity="full"``: whole transformer layers are recomputed, only a layer
  group's input is kept.  ``recompute_method`` is required:

  - ``"uniform"``: the layers are cut into consecutive groups of ``recompute_num_layers``; each
    group is one checkpoint (only its input is kept);
  - ``"block"``: the first ``recompute_num_layers`` layers are each checkpointed on their own;
    the rest run without recompute.

Recompute acts only in training mode with gradients enabled (Megatron: ``self.training``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclasses.dataclass(frozen=True)
class Recompute:
    """What is recomputed in a model of ``total_layers`` layers (checked on construction)."""

    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None
    total_layers: int = 1

    def __post_init__(self) -> None:
        g, m, n, total = self.granularity, self.method, self.num_layers, self.total_layers
        if g is None:
            if m is not None or n is not None:
                raise ValueError(f"recompute_method={m!r} / recompute_num_layers={n!r} need "
                                 f"recompute_granularity ('full' or 'selective')")
            return
        if g not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"recompute_granularity={g!r}: expected one of {RECOMPUTE_GRANULARITIES} or None")
        if m is not None and m not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute_method={m!r}: expected one of {RECOMPUTE_METHODS}")
        if g == "selective":
            if m is not None or n is not None:
                raise ValueError(f"recompute_granularity='selective' recomputes the attention core of every "
                                 f"layer: recompute_method ({m!r}) and recompute_num_layers ({n!r}) must be None")
            return
        if m is None:
            raise ValueError("recompute_granularity='full' needs recompute_method 'uniform' or 'block'")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= total:
            raise ValueError(f"recompute_granularity='full': recompute_num_layers={n!r} must be an int between 1 "
                             f"and the number of layers, {total}")
        if m == "uniform" and total % n:
            raise ValueError(f"recompute_method='uniform' cuts the {total} layers into groups of "
                             f"recompute_num_layers={n}, which does not divide {total}")

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"

    def segments(self) -> list[tuple[int, int, bool]]:
        """``(start, end, recomputed)`` runs of layers covering ``range(total_layers)`` in order."""
        total, n = self.total_layers, self.num_layers
        if self.granularity != "full":
            return [(0, total, False)]
        if self.method == "uniform":
            return [(i, i + n, True) for i in range(0, total, n)]
        return [(i, i + 1, True) for i in range(n)] + ([(n, total, False)] if n < total else [])


def recompute_active(module: torch.nn.Module) -> bool:
    """Recompute runs only while training with gradients on (an eval or no-grad forward keeps nothing)."""
    return module.training and torch.is_grad_enabled()


def checkpointed(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` keeping only its inputs; run again in backward for the saved tensors.

    torch's non-reentrant checkpoint: the RNG states (CPU, and the inputs' device) are saved and
    restored around the second run, outputs need no input that requires grad, and the tensors
    of the second run are checked against the first's shapes and dtypes.
    """
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
