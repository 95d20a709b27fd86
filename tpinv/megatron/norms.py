"""megatron-core's local-spec norms with token sums in one fixed order.

Invariant kept: a norm's weight and bias gradients -- sums over every token of the batch -- are
the same bits whatever the thread count, the TP size or the process.  megatron-core's local spec
builds ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` (``WrappedTorchNorm``), whose CPU backward
splits the tokens of those sums among threads: a TP=1 run with the default threads and a TP=2
run under ``torchrun`` (one thread a rank) then train different weights.  :class:`InvariantNorm`
computes the normalisation in fp32 with torch's per-row function (each row alone: no sum over
tokens), applies the weight and bias through :class:`AffineByTokens` (one rounding to the
input's dtype), whose backward sums the tokens in fp32 in the fixed order of
``tree_sum(leaves=1)`` (contiguous halving; the order of the biases megatron adds itself), and
leaves the input's gradient to the per-row backward.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tpinv.core.autograd import apply_function
from tpinv.megatron.layers import token_sum

__all__ = ["AffineByTokens", "InvariantNorm", "NORM_TYPES"]


class AffineByTokens(torch.autograd.Function):
    """``normed * weight (+ bias)`` from the fp32 ``normed``, in fp32, rounded once to ``dtype``;
    the weight's and bias's gradients sum the tokens in fp32 in one fixed order, rounded once
    to the parameter's dtype."""

    @staticmethod
    def forward(ctx, normed, weight, bias, dtype):
        ctx.save_for_backward(normed, weight)
        ctx.has_bias = bias is not None
        y = normed * weight.float()
        return (y + bias.float() if bias is not None else y).to(dtype)

    @staticmethod
    def backward(ctx, dy):
        normed, weight = ctx.saved_tensors
        dy = dy.float()
        d_weight = token_sum(dy * normed).to(weight.dtype)
        d_bias = token_sum(dy).to(weight.dtype) if ctx.has_bias else None
        return dy * weight.float(), d_weight, d_bias, None


class InvariantNorm(torch.nn.Module):
    """``torch.nn.LayerNorm`` (``kind="LayerNorm"``) or ``torch.nn.RMSNorm`` over the last dim,
    with :class:`AffineByTokens`' parameter gradients; the same parameters and ``eps``."""

    def __init__(self, kind: str, hidden_size: int, eps: Optional[float], *, bias: bool,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        if kind not in ("LayerNorm", "RMSNorm"):
            raise NotImplementedError(f"InvariantNorm: {kind!r} is not supported (LayerNorm, RMSNorm)")
        if kind == "RMSNorm" and bias:
            raise ValueError("InvariantNorm: an RMSNorm has no bias")
        self.kind, self.hidden_size, self.eps = kind, int(hidden_size), eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_torch(cls, norm: torch.nn.Module) -> "InvariantNorm":
        """The same norm as ``norm`` (a ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` with an
        elementwise affine over one dim), its parameters copied."""
        kind = NORM_TYPES.get(type(norm))
        shape = tuple(norm.normalized_shape)
        if kind is None or len(shape) != 1 or norm.weight is None:
            raise NotImplementedError(f"InvariantNorm.from_torch: {type(norm).__name__} over {shape} with "
                                      f"elementwise_affine={norm.weight is not None} is not supported "
                                      f"(LayerNorm or RMSNorm over the last dim, with a weight)")
        bias = getattr(norm, "bias", None)
        new = cls(kind, shape[0], norm.eps, bias=bias is not None, dtype=norm.weight.dtype,
                  device=norm.weight.device)
        with torch.no_grad():
            new.weight.copy_(norm.weight)
            if bias is not None:
                new.bias.copy_(bias)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, wide = (self.hidden_size,), x.float()   # fp32 throughout, one rounding at the end
        if self.kind == "LayerNorm":
            normed = F.layer_norm(wide, shape, None, None, 1e-5 if self.eps is None else self.eps)
        else:
            eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps   # torch's default: the input's
            normed = F.rms_norm(wide, shape, None, eps)
        return apply_function(AffineByTokens, normed, self.weight, self.bias, x.dtype)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.hidden_size}, eps={self.eps}, bias={self.bias is not None}"


#: The torch norm classes megatron-core's local spec builds, and the kind each is.
NORM_TYPES = {torch.nn.LayerNorm: "LayerNorm", torch.nn.RMSNorm: "RMSNorm"}
