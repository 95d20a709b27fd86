"""``enable(seed)``: seed every RNG and put the process in a state that cannot silently change bits.

The invariant paths of tpinv fix the order of every reduction themselves; what this module
removes is everything *around* them that could still change a run's bits from one launch to
the next: unseeded RNGs (Python, NumPy, torch CPU and CUDA), hash randomization in child
processes, cuBLAS's multi-stream workspaces, TF32 in fp32 GEMMs and convolutions, and
non-deterministic torch kernels.  It also refuses environment settings that would break the
invariance contract and that cannot be undone from inside the process (libraries read them
once, at load time), naming the setting and the reason.

``enable`` is idempotent: calling it again with the same seed changes nothing and returns an
equal record; calling it with another seed reseeds.  It never restores or hides state, so
nesting calls is safe.  The record says exactly what is in force and what this call changed.
"""
from __future__ import annotations

import dataclasses
import os
import random
from typing import Mapping, Optional

import numpy as np
import torch

from tpinv.core.contract import InvarianceError

__all__ = ["DeterminismRecord", "enable", "check_environment", "REFUSED_SETTINGS",
           "DETERMINISTIC_CUBLAS_WORKSPACES"]

#: cuBLAS workspace settings under which its results are run-to-run deterministic (CUDA docs).
DETERMINISTIC_CUBLAS_WORKSPACES = (":4096:8", ":16:8")
_FALSE = ("", "0", "false", "no", "off")


def _truthy(value: Optional[str]) -> bool:
    return value is not None and value.strip().lower() not in _FALSE


def _tf32_override(value: Optional[str]) -> Optional[str]:
    if _truthy(value):
        return ("it makes cuBLAS run fp32 GEMMs in TF32 (10-bit mantissa) even when "
                "torch.backends.cuda.matmul.allow_tf32 is False, so fp32 results change with the "
                "kernel cuBLAS picks; unset it")
    return None


def _cublas_workspace(value: Optional[str]) -> Optional[str]:
    if value is not None and value not in DETERMINISTIC_CUBLAS_WORKSPACES:
        return (f"cuBLAS is run-to-run deterministic only with CUBLAS_WORKSPACE_CONFIG in "
                f"{DETERMINISTIC_CUBLAS_WORKSPACES}; other workspaces let it split reductions "
                f"across streams in a varying order; set it to ':4096:8' or unset it")
    return None


def _triton_interpret(value: Optional[str]) -> Optional[str]:
    if _truthy(value) and torch.cuda.is_available():
        return ("with a GPU present the Triton kernels would run in the CPU interpreter, whose "
                "numerics are NumPy's (and whose bf16 tl.dot is wrong), so a GPU run would not "
                "compute the bits of the compiled kernels; unset it")
    return None


#: Environment variable -> check returning why its value breaks invariance (or None).
REFUSED_SETTINGS = {
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": _tf32_override,
    "CUBLAS_WORKSPACE_CONFIG": _cublas_workspace,
    "TRITON_INTERPRET": _triton_interpret,
}


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Raise :class:`InvarianceError` naming every refused setting in ``environ`` (default: os.environ)."""
    environ = os.environ if environ is None else environ
    problems = []
    for name, check in REFUSED_SETTINGS.items():
        why = check(environ.get(name))
        if why:
            problems.append(f"{name}={environ.get(name)!r}: {why}")
    if problems:
        raise InvarianceError("refusing to run with settings that break bitwise invariance:\n  "
                              + "\n  ".join(problems))


@dataclasses.dataclass(frozen=True)
class DeterminismRecord:
    """What :func:`enable` put in force (``env``, ``torch_flags``) and what this call changed."""

    seed: int
    env: dict
    torch_flags: dict
    changed: tuple


def _set_env(name: str, value: str, changed: list) -> None:
    if os.environ.get(name) is None:
        os.environ[name] = value
        changed.append(f"env {name}={value}")


def _set_flag(obj, attr: str, value, label: str, changed: list, flags: dict) -> None:
    try:
        if getattr(obj, attr) != value:
            setattr(obj, attr, value)
            changed.append(f"{label}={value}")
        flags[label] = getattr(obj, attr)
    except (AttributeError, RuntimeError):  # a torch without the flag, or the new fp32 API in use
        flags[label] = "unavailable"


def enable(seed: int) -> DeterminismRecord:
    """Seed every RNG with ``seed`` and fix the deterministic settings; refuse unsafe ones.

    * Python ``random``, NumPy's global RNG, torch's CPU and every CUDA generator: ``seed``;
    * ``PYTHONHASHSEED`` (for child processes; this process's hashing was fixed at start-up)
      and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when unset -- a value already set is kept,
      after :func:`check_environment` has accepted it;
    * TF32 off for CUDA matmuls and cuDNN, fp32 matmul precision ``"highest"``, reduced-
      precision bf16/fp16 GEMM reductions off, cuDNN deterministic and not benchmarking;
    * ``torch.use_deterministic_algorithms(True)`` (errors, not warnings).  Every CPU op the
      tpinv models and training loop use has a deterministic implementation.

    Raises :class:`InvarianceError` (before changing anything) if a refused setting is present.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed={seed!r}: expected an int in [0, 2**63)")
    check_environment()
    changed: list[str] = []
    _set_env("PYTHONHASHSEED", str(seed % 2**32), changed)
    _set_env("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS_WORKSPACES[0], changed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds the CPU and every CUDA generator
    flags: dict = {}
    _set_flag(torch.backends.cuda.matmul, "allow_tf32", False, "cuda.matmul.allow_tf32", changed, flags)
    _set_flag(torch.backends.cudnn, "allow_tf32", False, "cudnn.allow_tf32", changed, flags)
    _set_flag(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False,
              "cuda.matmul.allow_bf16_reduced_precision_reduction", changed, flags)
    _set_flag(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", False,
              "cuda.matmul.allow_fp16_reduced_precision_reduction", changed, flags)
    _set_flag(torch.backends.cudnn, "deterministic", True, "cudnn.deterministic", changed, flags)
    _set_flag(torch.backends.cudnn, "benchmark", False, "cudnn.benchmark", changed, flags)
    if torch.get_float32_matmul_precision() != "highest":
        torch.set_float32_matmul_precision("highest")
        changed.append("float32_matmul_precision=highest")
    flags["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    if not torch.are_deterministic_algorithms_enabled() or \
            torch.is_deterministic_algorithms_warn_only_enabled():
        torch.use_deterministic_algorithms(True, warn_only=False)
        changed.append("use_deterministic_algorithms=True")
    flags["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
    env = {name: os.environ.get(name) for name in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG")}
    return DeterminismRecord(seed=seed, env=env, torch_flags=flags, changed=tuple(changed))
