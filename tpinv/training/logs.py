"""The trainer's messages through Python ``logging``, each line naming the rank that wrote it.

Logger ``"tpinv"`` (and its children, e.g. ``"tpinv.training"``) writes to stderr as
``2026-01-01 12:00:00 [rank 3/4 tp 1/2 dp 1/2] INFO tpinv.training: message`` at the level of
``--log-level``.  The report lines of a run -- the start line, the step lines with their hex
floats, the checkpoint and final lines -- are not log messages: they stay on stdout, written
by global rank 0 only (:mod:`tpinv.training.metrics`), so programs that parse them see the same
text at every log level.
"""
from __future__ import annotations

import logging
import sys
from typing import IO, Optional

__all__ = ["LEVELS", "LOGGER_NAME", "configure_logging", "rank_prefix"]

LOGGER_NAME = "tpinv"
LEVELS = ("debug", "info", "warning", "error")


def rank_prefix(rank: int, world: int, tp_rank: int = 0, tp: int = 1, dp_rank: int = 0, dp: int = 1) -> str:
    """``[rank 3/4 tp 1/2 dp 1/2]``: the global rank and the TP and DP coordinates of a process."""
    return f"[rank {rank}/{world} tp {tp_rank}/{tp} dp {dp_rank}/{dp}]"


class _RankHandler(logging.StreamHandler):
    """The handler :func:`configure_logging` installs (replaced, never stacked, when called again)."""


def configure_logging(level: str = "info", *, rank: int = 0, world: int = 1, tp_rank: int = 0, tp: int = 1,
                      dp_rank: int = 0, dp: int = 1, stream: Optional[IO[str]] = None) -> logging.Logger:
    """Set the ``"tpinv"`` logger's level and its one rank-prefixed handler; returns the logger."""
    if level not in LEVELS:
        raise ValueError(f"log_level={level!r}: choose from {', '.join(LEVELS)}")
    logger = logging.getLogger(LOGGER_NAME)
    for h in [h for h in logger.handlers if isinstance(h, _RankHandler)]:
        logger.removeHandler(h)
    handler = _RankHandler(stream if stream is not None else sys.stderr)
    prefix = rank_prefix(rank, world, tp_rank, tp, dp_rank, dp).replace("%", "%%")
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s",
                                           datefmt="%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False  # one line per message, whatever the root logger holds
    return logger
