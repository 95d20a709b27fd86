"""Calling an autograd function only where a gradient may be recorded.

Invariant kept: :func:`apply_function` computes exactly what ``fn.apply(*args)`` computes --
it runs the same ``fn.forward`` on the same arguments -- and differs only in whether an
autograd node is recorded.  With no gradient to record (grad mode off, or no tensor argument
requiring one: inference, decoding, a frozen reference model's log-probs) it calls
``fn.forward`` with a plain :class:`torch.autograd.function.FunctionCtx` and skips
``Function.apply``'s host work (a decode step of a 28-layer model makes ~250 such calls).
Where the call may be watched or transformed (:func:`observed`: ``torch.compile``, a dispatch
or function mode, the profiler, a functorch transform) or an argument is a tensor subclass,
``fn.apply`` runs, as before.  The ops' direct eager calls (:mod:`tpinv.ops.registry`) use the
same two tests.
"""
from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

__all__ = ["apply_function", "direct_forwards", "observed", "PLAIN_TENSORS"]

#: The tensor types a direct call takes; any other tensor (a subclass) goes through torch.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def observed() -> bool:
    """Whether something may watch or transform a call: torch.compile, a dispatch or function
    mode, the profiler or a functorch transform (then it goes through torch's own path)."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled() or torch.autograd._profiler_enabled()
            or torch._C._are_functorch_transforms_active())


_DIRECT = [0]


def direct_forwards() -> int:
    """How many calls so far ran ``fn.forward`` directly (tests assert it moves)."""
    return _DIRECT[0]


def apply_function(fn: type, *args):
    """``fn.apply(*args)`` for a :class:`torch.autograd.Function` ``fn``; without a gradient to
    record, ``fn.forward(FunctionCtx(), *args)`` (the same computation, no node)."""
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in PLAIN_TENSORS or (grad and a.requires_grad)):
            return fn.apply(*args)
    if observed():
        return fn.apply(*args)
    _DIRECT[0] += 1
    return fn.forward(FunctionCtx(), *args)
