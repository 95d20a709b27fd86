"""The installed megatron-core version, detected once, and the supported range.

Invariant kept: tpinv's megatron integration runs only on a megatron-core whose minor
version lies in :data:`SUPPORTED_RANGE`; anything else is refused with a message naming the
installed version and the range -- never a silent fallback.
"""
from __future__ import annotations

import functools
import importlib.metadata

#: Oldest and newest supported ``(major, minor)``; every patch release of each minor in between.
SUPPORTED_RANGE = ((0, 12), (0, 16))


def _parse(text: str) -> tuple[int, int, int]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or "0"))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def check_version(text: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of ``text``; raises ``RuntimeError`` outside :data:`SUPPORTED_RANGE`."""
    v = _parse(text)
    lo, hi = SUPPORTED_RANGE
    if not lo <= v[:2] <= hi:
        raise RuntimeError(
            f"megatron-core {text} is not supported by tpinv.megatron: supported versions are "
            f"{lo[0]}.{lo[1]}.x through {hi[0]}.{hi[1]}.x")
    return v


@functools.lru_cache(maxsize=None)
def megatron_version() -> tuple[int, int, int]:
    """The installed megatron-core's version (checked against the supported range, once per process)."""
    try:
        text = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError as e:
        raise ImportError("tpinv.megatron needs megatron-core: pip install 'tpinv[megatron]'") from e
    return check_version(text)
