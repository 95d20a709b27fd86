"""tpinv: tensor-parallel-invariant layers, models and tools.

Every layer computes the same bits at any tensor-parallel size, any batch size, in
training and in inference, by fixing the order of every reduction (see
:mod:`tpinv.core.contract` and ``docs/invariance.md``).  Importing ``tpinv`` has no side
effects: it overrides no aten op and changes no global setting.  It refuses a torch older
than :data:`TORCH_FLOOR`, the oldest release the test suite passed on (``docs/versions.md``).
"""
import torch as _torch

from tpinv.core.versions import torch_at_least as _torch_at_least

#: The oldest torch release (major, minor) tpinv supports: setup.cfg's ``torch>=`` and docs/versions.md.
TORCH_FLOOR = (2, 6)


def _require_torch(installed: str) -> None:
    """Raise ImportError when the torch release ``installed`` (e.g. ``"2.5.1+cu124"``) is below the floor."""
    if not _torch_at_least(TORCH_FLOOR, installed):
        need = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(f"tpinv needs torch >= {need}, but torch {installed} is installed "
                          f"(pip install 'torch>={need}'; docs/versions.md lists the tested versions)")


_require_torch(_torch.__version__)

from tpinv.core.compile import compile  # noqa: E402
from tpinv.core.contract import DEFAULT_LEAVES, TP_MAX, InvarianceError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["DEFAULT_LEAVES", "TP_MAX", "TORCH_FLOOR", "InvarianceError", "__version__", "compile"]
