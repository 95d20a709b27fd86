"""Invariant SiLU-and-multiply (the SwiGLU MLP's ``silu(gate) * up``) on CPU.

Each output element depends only on its own ``gate`` and ``up`` values: in fp32,
``silu(g) = g / (1 + exp(-g))`` is built from separate exact elementwise ops (negate,
exp, add, divide), then multiplied by ``up`` and rounded once to the input dtype.
``torch.sigmoid`` and ``F.silu`` are not used: their vectorized and scalar-tail code
paths give different bits for the same value, so their result depends on where an
element sits in the tensor.  Backward, with ``sig = 1 / (1 + exp(-g))``::

    d_gate = grad * up * (sig * (1 + g * (1 - sig)))
    d_up   = grad * silu(g)
"""
from __future__ import annotations

import torch

from tpinv.core.contract import InvarianceError, check_dtype


def check_silu_mul_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    """Raise a clear error for inputs :func:`silu_mul_forward` does not accept."""
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise TypeError("silu_mul expects two tensors gate and up of the same shape")
    check_dtype(gate.dtype, "silu_mul gate")
    if up.dtype != gate.dtype:
        raise TypeError(f"silu_mul up must have the gate's dtype {gate.dtype}, got {up.dtype}")
    if up.shape != gate.shape:
        raise InvarianceError(
            f"silu_mul up must have the gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")


def _one_plus_exp_neg(g: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.neg(g)) + 1.0


def silu_f32(g: torch.Tensor) -> torch.Tensor:
    """Position-independent fp32 ``g / (1 + exp(-g))`` of an fp32 tensor."""
    return g / _one_plus_exp_neg(g)


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, rounded once to the input dtype."""
    check_silu_mul_inputs(gate, up)
    g = gate.to(torch.float32)
    return (silu_f32(g) * up.to(torch.float32)).to(gate.dtype)


def silu_mul_backward(grad: torch.Tensor, gate: torch.Tensor,
                      up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_gate, d_up)`` of :func:`silu_mul_forward`, in the input dtype."""
    check_silu_mul_inputs(gate, up)
    if grad.shape != gate.shape:
        raise InvarianceError(
            f"silu_mul grad must have shape {tuple(gate.shape)}, got {tuple(grad.shape)}")
    g = gate.to(torch.float32)
    u = up.to(torch.float32)
    grad_f32 = grad.to(torch.float32)
    denom = _one_plus_exp_neg(g)
    sig = torch.reciprocal(denom)
    dsilu = sig * ((g * (1.0 - sig)) + 1.0)
    grad_gate = (grad_f32 * u) * dsilu
    grad_up = grad_f32 * (g / denom)
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)
