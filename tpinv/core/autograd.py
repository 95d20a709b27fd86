"""Calling an autograd function only where a gradient may be recorded.

Invariant kept: :func:`apply_function` computes exactly what ``fn.apply(*args)`` computes --
it runs the same ``fn.forward`` on the same arguments -- and differs only in whether an
autograd node is recorded.  With no gradient to record (grad mode off, or no tensor argument
requiring one: inference, decoding, a frozen reference model's log-probs) it calls
``fn.forward`` with a throwaway context and skips ``Function.apply``'s host work (a decode step
of a 28-layer model makes ~250 such calls).  Under ``torch.compile``, a functorch transform or
a torch function mode (DTensor, an observer), ``fn.apply`` always runs, as before.
"""
from __future__ import annotations

import torch

__all__ = ["apply_function", "direct_forwards"]


class _NoGradContext:
    """The context a forward sees when no node is recorded: it keeps what the forward sets and
    saves nothing (no backward will read it)."""

    needs_input_grad: tuple = ()
    saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def mark_dirty(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


_DIRECT = [0]


def direct_forwards() -> int:
    """How many calls so far ran ``fn.forward`` directly (tests assert it moves)."""
    return _DIRECT[0]


def apply_function(fn: type, *args):
    """``fn.apply(*args)`` for a :class:`torch.autograd.Function` ``fn``; without a gradient to
    record, ``fn.forward(ctx, *args)`` with a context that saves nothing (same computation)."""
    if (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)) \
            or torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled() \
            or torch._C._are_functorch_transforms_active() \
            or any(type(a) not in _PLAIN and isinstance(a, torch.Tensor) for a in args):
        return fn.apply(*args)
    _DIRECT[0] += 1
    return fn.forward(_NoGradContext(), *args)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
