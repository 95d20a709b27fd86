"""``tpinv.compile``: torch.compile with the settings under which a compiled tpinv model computes
the eager model's bits, forward and backward.

The invariant kept: every reduction and every ``exp``/``log``/``cos``/``sin`` of a tpinv model
runs inside a ``tpinv::`` custom op, which a compiled graph calls as an opaque kernel (the eager
kernel, on the same contiguous inputs); inductor generates code only for the glue between ops --
views, copies, casts, residual adds, masks.  Those are exact elementwise ops *if each rounds
where eager rounds*.  By default inductor fuses a cast into its consumer and keeps the fp32
value (``matmul_partial(x, w).to(bf16) + residual`` then rounds once where eager rounds twice),
so a plain ``torch.compile`` of a bf16 model differs from eager in the last bits.
``emulate_precision_casts=True`` makes the generated code round at every cast as eager does;
this helper sets it (per compile, through ``options``: no global setting changes) and refuses
an ``options`` value that would undo it.  fp32 models have no such cast and compile to the eager
bits with plain ``torch.compile`` too.  See ``docs/compile.md``.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from tpinv.core.versions import torch_at_least

__all__ = ["BACKENDS", "INDUCTOR_OPTIONS", "FORCED_SIMDLEN", "compile", "forced_simdlen"]

#: Inductor options a compiled tpinv model needs for the eager bits.
INDUCTOR_OPTIONS: dict[str, Any] = {"emulate_precision_casts": True}

#: Inductor's vector length (``cpp.simdlen``) for each forced ATen CPU kernel set.  With
#: ``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 machine and ``cpp.simdlen`` unset, inductor (torch 2.13)
#: generated 16-lane loops over 8-lane AVX2 vectors -- stores past the vectors, garbage in the
#: tensors saved for backward; naming the length gives loops and vectors one width.
FORCED_SIMDLEN = {"avx2": 256, "avx512": 512, "default": 1}


def forced_simdlen() -> Optional[int]:
    """:data:`FORCED_SIMDLEN` of the kernel set ``ATEN_CPU_CAPABILITY`` forces, or None when none is forced."""
    return FORCED_SIMDLEN.get(os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower())


#: The backends with a same-bits claim: ``inductor`` (with :data:`INDUCTOR_OPTIONS`), and the
#: tracing-only ``aot_eager``/``eager``, which run the traced graph's ATen ops as eager does.
BACKENDS = ("inductor", "aot_eager", "eager")

#: The oldest torch (major, minor) on which tpinv.compile's guarantees were tested.  Below it the
#: compile is refused: on torch 2.6 the in-graph value checks did not raise and compiled bf16 layers
#: gave another loss than eager (docs/compile.md, docs/versions.md).
COMPILE_TORCH_FLOOR = (2, 13)


def check_compile_torch(installed: Optional[str] = None) -> None:
    """Raise NotImplementedError when torch ``installed`` (default: this torch) is below :data:`COMPILE_TORCH_FLOOR`."""
    installed = torch.__version__ if installed is None else installed
    if not torch_at_least(COMPILE_TORCH_FLOOR, installed):
        need = ".".join(map(str, COMPILE_TORCH_FLOOR))
        raise NotImplementedError(f"tpinv.compile needs torch >= {need} (the oldest release its same-bits and "
                                  f"in-graph check guarantees were tested on); torch {installed} is installed. "
                                  f"Run eager, or replay a CUDA graph (tpinv.engine's cuda_graph=True)")


def compile(model: Callable, *, backend: str = "inductor", fullgraph: bool = True,
            dynamic: Optional[bool] = None, options: Optional[dict[str, Any]] = None, **kwargs) -> Callable:
    """``torch.compile(model, ...)`` that computes ``model``'s eager bits (a module or a function).

    ``fullgraph=True`` by default: a graph break is an error, not a silent split.  ``options``
    are passed to inductor on top of :data:`INDUCTOR_OPTIONS`; one that changes those raises.
    Under a forced CPU kernel set the vector length is named too (:func:`forced_simdlen`).
    """
    check_compile_torch()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: tpinv.compile supports {BACKENDS} (the backends whose "
                         f"compiled bits are the eager bits); call torch.compile yourself for another")
    merged = dict(options or {})
    for key, value in INDUCTOR_OPTIONS.items():
        if merged.get(key, value) != value:
            raise ValueError(f"options[{key!r}]={merged[key]!r}: tpinv.compile needs {key}={value!r} for the "
                             f"eager bits (see docs/compile.md)")
        merged[key] = value
    if forced_simdlen() is not None:
        merged.setdefault("cpp.simdlen", forced_simdlen())
    if backend != "inductor":
        if options:
            raise ValueError(f"options are inductor options; backend={backend!r} takes none")
        return torch.compile(model, backend=backend, fullgraph=fullgraph, dynamic=dynamic, **kwargs)
    return torch.compile(model, backend=backend, fullgraph=fullgraph, dynamic=dynamic, options=merged, **kwargs)
