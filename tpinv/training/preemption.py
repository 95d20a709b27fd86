"""Megatron's ``--exit-signal-handler``: on SIGTERM every rank finishes the step it is in, the run
saves a complete checkpoint and stops with exit status 0, resumable with ``--load``.

Invariant: all ranks stop after the *same* step.  The handler only records the signal; after
each step the ranks OR their flags with one all-reduce over the world, so a signal delivered
to one rank (or to each at a different moment) stops every rank at the same step boundary.
"""
from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["ExitSignalHandler"]


class ExitSignalHandler:
    """Records ``sig`` (SIGTERM) while installed; :meth:`stop_requested` is collective over ``group``."""

    def __init__(self, sig: int = signal.SIGTERM, *, distributed: bool = False, device: Optional[torch.device] = None):
        self.sig, self.distributed, self.received = sig, distributed, False
        self.device = device or torch.device("cpu")
        self._previous = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - the signal module's signature
        self.received = True

    def stop_requested(self) -> bool:
        """True on every rank when any rank received the signal (one all-reduce over the world)."""
        if not self.distributed or dist.get_world_size() == 1:
            return self.received
        flag = torch.tensor([int(self.received)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        """Give the signal its previous handler back."""
        if self._previous is not None:
            signal.signal(self.sig, self._previous)
            self._previous = None
