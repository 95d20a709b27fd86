"""DTensor tensor-parallel plans for HF-style decoders: vanilla, column-only, invariant.

:mod:`tpinv.dtensor.plans` holds the plans and ``parallelize``; :mod:`tpinv.dtensor.styles` the
invariant ``ParallelStyle`` classes; :mod:`tpinv.dtensor.hf_modules` the tpinv replacements for
HF's norm, rotary, MLP and attention modules.
"""
from tpinv.dtensor.plans import (PLANS, ModelLayout, cross_entropy, default_plan, invariant_plan,
                                 numerically_stable_plan, parallelize, validate)

__all__ = ["PLANS", "ModelLayout", "default_plan", "numerically_stable_plan", "invariant_plan", "validate",
           "parallelize", "cross_entropy"]
