"""tpinv: tensor-parallel-invariant layers, models and tools.

Every layer computes the same bits at any tensor-parallel size, any batch size, in
training and in inference, by fixing the order of every reduction (see
:mod:`tpinv.core.contract` and ``docs/invariance.md``).  Importing ``tpinv`` has no side
effects: it overrides no aten op and changes no global setting.
"""
from tpinv.core.compile import compile
from tpinv.core.contract import DEFAULT_LEAVES, TP_MAX, InvarianceError

__version__ = "0.1.0"
__all__ = ["DEFAULT_LEAVES", "TP_MAX", "InvarianceError", "__version__", "compile"]
