"""Hugging Face transformers 4.x and 5.x side by side: config arguments both accept.

transformers 5 reads RoPE settings from one ``rope_parameters`` dict (theta included);
transformers 4 reads ``rope_theta`` and a ``rope_scaling`` dict (None for the default rope) and
ignores ``rope_parameters``, silently building the default rope.  :func:`rope_config_kwargs`
gives the arguments the installed version reads, so a test or a user script builds the same
model under either.  (A ``config.json`` written by tpinv's converter carries the legacy keys,
which both versions read.)
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["TRANSFORMERS_MAJOR", "rope_config_kwargs", "rope_init_function"]


def _major() -> Optional[int]:
    try:
        import transformers
    except ImportError:
        return None
    return int(transformers.__version__.split(".")[0])


#: The installed transformers' major version (None when transformers is not installed).
TRANSFORMERS_MAJOR = _major()


def rope_config_kwargs(rope_theta: float, rope_type: str = "default", **scaling: Any) -> dict:
    """Keyword arguments for a HF ``*Config(...)`` giving RoPE ``rope_type`` with base
    ``rope_theta`` and the scaling fields ``scaling`` (``factor``, ``low_freq_factor``...)."""
    if TRANSFORMERS_MAJOR is None:
        raise ImportError("transformers is not installed")
    if TRANSFORMERS_MAJOR >= 5:
        return {"rope_parameters": {"rope_type": rope_type, "rope_theta": rope_theta, **scaling}}
    if rope_type == "default":
        if scaling:
            raise ValueError(f"the default rope takes no scaling fields, got {sorted(scaling)}")
        return {"rope_theta": rope_theta, "rope_scaling": None}
    return {"rope_theta": rope_theta, "rope_scaling": {"rope_type": rope_type, **scaling}}


def rope_init_function(rope_type: str):
    """HF's inverse-frequency function for ``rope_type``, called as ``fn(config)`` under both
    versions (transformers 4 requires the device argument, 5 makes it optional)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn = ROPE_INIT_FUNCTIONS[rope_type]
    return lambda config: fn(config, None)
