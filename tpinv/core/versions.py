"""Torch releases as ``(major, minor)``: the one reading of a version string for every version rule
(tpinv's floor at import, features that need a newer torch, tests that skip below one)."""
from __future__ import annotations

import re
from typing import Optional

__all__ = ["torch_at_least", "torch_release"]


def torch_release(version: Optional[str] = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed torch's), ``(0, 0)`` if unreadable."""
    if version is None:
        import torch
        version = torch.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    return tuple(map(int, found.groups())) if found else (0, 0)


def torch_at_least(floor: tuple[int, int], version: Optional[str] = None) -> bool:
    """Whether torch ``version`` (default: the installed one) is ``floor`` or newer."""
    return torch_release(version) >= tuple(floor)
