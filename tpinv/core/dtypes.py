"""Every dtype name tpinv reads or writes, in one table.

Invariant: one name maps to one dtype everywhere -- checkpoints (``tpinv.json``), HF configs,
command-line flags, safetensors headers and the tree reducer's descriptors all use the
tables here, so a name written by one component is read back as the same dtype by every
other.  Names are torch's (``"bfloat16"``); the short forms ``bf16``/``fp16``/``fp32`` are
accepted on input only and are never written.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

__all__ = ["MODEL_DTYPES", "NAMES", "SHORT_NAMES", "CLI_CHOICES", "SAFETENSORS_CODES",
           "dtype_name", "dtype_from_name", "cli_dtype"]

#: dtypes a tpinv model computes in (parameters and activations); the contract's SUPPORTED_DTYPES.
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: torch's name of every dtype a checkpoint or descriptor may hold (the written form).
NAMES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "complex64": torch.complex64, "complex128": torch.complex128,
}

#: the short forms accepted on input (flags, configs).
SHORT_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: the values of a ``--dtype`` flag; ``keep`` means "the dtype the checkpoint has".
CLI_CHOICES = ("keep", "bf16", "fp16", "fp32")

#: safetensors header codes (the safetensors format's names).
SAFETENSORS_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``), the form tpinv writes."""
    name = str(dtype).removeprefix("torch.")
    if NAMES.get(name) is not dtype:
        raise ValueError(f"dtype {dtype} has no tpinv name; expected one of {sorted(NAMES)}")
    return name


def dtype_from_name(name: str, *, allowed: Optional[Iterable[torch.dtype]] = None,
                    error: type[Exception] = ValueError, what: str = "dtype") -> torch.dtype:
    """The dtype called ``name`` (torch's name or a short form); ``allowed`` narrows the choice.

    Raises ``error`` naming ``what`` and the accepted names.
    """
    dtype = NAMES.get(name) if isinstance(name, str) else None
    if dtype is None and isinstance(name, str):
        dtype = SHORT_NAMES.get(name)
    allowed = tuple(NAMES.values()) if allowed is None else tuple(allowed)
    if dtype is None or dtype not in allowed:
        names = sorted(n for n, d in NAMES.items() if d in allowed)
        raise error(f"{what} {name!r} is not supported; expected one of {names}")
    return dtype


def cli_dtype(flag: str) -> Optional[torch.dtype]:
    """The dtype of a ``--dtype`` flag from :data:`CLI_CHOICES`; ``None`` for ``keep``."""
    return None if flag == "keep" else dtype_from_name(flag, allowed=MODEL_DTYPES, what="--dtype")
