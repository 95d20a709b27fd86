"""What this GPU and this Triton can run: multiprocessors, compute capability, the Gluon kernels.

Invariant kept: nothing here chooses an operation, only which kernel computes it -- where the Gluon
kernels cannot run (another GPU architecture, a Triton release whose Gluon they were not written
for, a Triton without Gluon) their Triton twins run, with the same bits.  Device properties are
asked of the driver once per device.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

__all__ = ["GLUON_TRITON", "gluon_version_reason", "gluon_device_reason", "gluon_module",
           "sm_count", "device_capability"]


#: Triton releases (major, minor) whose Gluon the Gluon kernels are written for and whose bits were
#: checked on a GPU.  Gluon's API moves between releases (after 3.6 ``thread_barrier`` became
#: ``barrier`` and the pointer copy into shared memory ``async_load``), and a Gluon kernel keeps
#: its Triton twin's bits through the same tile layouts, which a release may change; so another
#: release runs the Triton kernels, which give the same bits.
GLUON_TRITON = ((3, 6),)


def gluon_version_reason(version: Optional[str] = None) -> Optional[str]:
    """Why the Gluon kernels cannot be built with Triton ``version`` (this Triton's, looked at
    once, by default), or None when they can."""
    if version is None:
        if not _GLUON_REASON:
            import triton
            _GLUON_REASON.append(gluon_version_reason(triton.__version__))
        return _GLUON_REASON[0]
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return f"cannot read the Triton version {version!r}"
    if release in GLUON_TRITON:
        return None
    built = " / ".join(f"{major}.{minor}" for major, minor in GLUON_TRITON)
    return f"is written for the Gluon of Triton {built}, not of Triton {version}"


_GLUON_REASON: list = []  # [this Triton's gluon_version_reason], once looked at


def gluon_device_reason(device: torch.device) -> Optional[str]:
    """Why the Gluon kernels cannot run on ``device`` (an sm_90 GPU and this Triton's Gluon
    release, :func:`gluon_version_reason`), or None when they can."""
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    if device_capability(device) != (9, 0):
        return f"needs an sm_90 GPU (wgmma), got capability {device_capability(device)}"
    return gluon_version_reason()


def gluon_module(name: str):
    """``tpinv.kernels.<name>``, a module of Gluon kernels, imported on its first use, or None
    where this Triton has no Gluon to import it with (then the Triton kernels run, same bits)."""
    if name not in _GLUON_MODULES:
        qualified = f"tpinv.kernels.{name}"
        try:
            _GLUON_MODULES[name] = importlib.import_module(qualified)
        except ImportError as exc:
            if getattr(exc, "name", None) == qualified:
                raise           # no such module of tpinv: a wrong name, never taken for a missing Gluon
            _GLUON_MODULES[name] = None  # a Triton without Gluon
    return _GLUON_MODULES[name]


_GLUON_MODULES: dict = {}  # module name -> the imported module, or None without Gluon


_SM_COUNT: dict = {}     # CUDA device index -> its multiprocessor count
_CAPABILITY: dict = {}   # CUDA device index -> its (major, minor) compute capability


def _per_device(cache: dict, device: torch.device, lookup):
    """``lookup(index)`` of CUDA ``device``, asked of the driver once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    value = cache.get(index)
    if value is None:
        value = cache[index] = lookup(index)
    return value


def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of CUDA ``device`` (looked up once per device): what persistent grids are
    sized by."""
    return _per_device(_SM_COUNT, device, _multiprocessors)


def device_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of CUDA ``device`` (looked up once per device): what picks a kernel."""
    return _per_device(_CAPABILITY, device, torch.cuda.get_device_capability)
