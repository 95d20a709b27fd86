"""The cross-entropy gradient by fixed torch code: the reference kernel of ``tpinv::cross_entropy_grad``.

Elementwise, one IEEE operation each, in fp32 from the logits in their own dtype::

    g = exp(float(x) - lse);  g = g + (-1) at a held target, g + (-0.0) elsewhere;  g = g * dloss

rounded once to ``x.dtype``.  An entry depends on its own logit and its row's values only.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["cross_entropy_grad"]


def cross_entropy_grad(x: Tensor, lse: Tensor, target: Tensor, outside: Tensor, dloss: Tensor) -> Tensor:
    """fp32 ``(exp(float(x) - lse) - onehot(target)) * dloss``, rounded once to ``x.dtype``."""
    grad = (x.to(torch.float32) - lse.unsqueeze(-1)).exp_()   # one fp32 buffer, updated in place below
    # minus the one-hot, in place: g + (-1) is g - 1 and g + (-0.0) is g (IEEE), one entry per row
    minus_hit = (~outside).to(grad.dtype).neg_().unsqueeze(-1)
    grad.scatter_add_(-1, target.masked_fill(outside, 0).unsqueeze(-1), minus_hit)
    return grad.mul_(dloss.unsqueeze(-1)).to(x.dtype)
