"""Queries and keys made ready for attention -- each head's RMSNorm (Qwen3's q/k norm, when the model
has it), then the rotary embedding -- as one autograd node, with the bits of the separate calls.

Invariant kept: every output and gradient is that of ``head_rms_norm`` then ``apply_rope`` called on
q and on k one by one (four autograd nodes, or two without the norms): the same ops on the same
values in the same order.  Nothing is summed across q and k, so grouping the calls changes no
value; it only saves the host work of the nodes.  :func:`norm_and_rope` takes the separate calls
wherever something else could see them (a hook on a norm module, a subclass or a replaced
``forward``, torch.compile, a dispatch mode): the same bits either way.
"""
from __future__ import annotations

from typing import Optional

import torch

from tpinv.core.autograd import PLAIN_TENSORS, apply_function, observed
from tpinv.layers.common import runs_only
from tpinv.layers.norm import HeadRMSNorm, head_rms_norm_backward
from tpinv.ops import apply_rope
from tpinv.ops.norm import rms_norm_op
from tpinv.ops.rope import apply_rope_input_grad, apply_rope_op

__all__ = ["norm_and_rope", "grouped_norm_rope_calls"]

_GROUPED = [0]


def grouped_norm_rope_calls() -> int:
    """How many :func:`norm_and_rope` calls so far ran as one node (tests assert it moves)."""
    return _GROUPED[0]


class _NormAndRope(torch.autograd.Function):
    """``rope(norm_q(q)^T), rope(norm_k(k)^T)`` for ``q, k [B, S, heads, D]`` (no norm where its
    weight is None); ``norms`` holds each norm's ``(eps, group, replicas)``."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, norms):
        ctx.norms, ctx.dtypes = norms, (q.dtype, k.dtype)
        ctx.has_norm = q_weight is not None
        if ctx.has_norm:   # head_rms_norm's call: on the contiguous input
            q, k = q.contiguous(), k.contiguous()
            ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
            q, k = rms_norm_op(q, q_weight, norms[0][0]), rms_norm_op(k, k_weight, norms[1][0])
        else:
            ctx.save_for_backward(cos, sin)
        return apply_rope_op(q.transpose(1, 2), cos, sin), apply_rope_op(k.transpose(1, 2), cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        if ctx.has_norm:
            q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        else:
            cos, sin = ctx.saved_tensors
        grads = [apply_rope_input_grad(g, cos, sin, dtype).transpose(1, 2) for g, dtype in zip((dq, dk), ctx.dtypes)]
        dw = [None, None]
        if ctx.has_norm:
            needs = ctx.needs_input_grad
            for i, (x, weight) in enumerate(((q, q_weight), (k, k_weight))):
                eps, group, replicas = ctx.norms[i]
                grads[i], w_grad = head_rms_norm_backward(grads[i], x, weight, eps, group, replicas)
                dw[i] = w_grad if needs[2 + i] else None
        return grads[0], grads[1], dw[0], dw[1], None, None, None


#: HeadRMSNorm's own forward (a replaced one makes the norms take their own calls).
_NORM_FORWARD = HeadRMSNorm.forward


def _norm_of(norm) -> bool:
    return norm is None or (runs_only(norm, HeadRMSNorm, _NORM_FORWARD) and type(norm.weight) in PLAIN_TENSORS)


def norm_and_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  q_norm: Optional[HeadRMSNorm] = None,
                  k_norm: Optional[HeadRMSNorm] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope(q_norm(q).transpose(1, 2), cos, sin)`` and the same of ``k`` (without the norms
    where they are None), for ``q, k [B, S, heads, D]``: ``[B, heads, S, D]`` each, as one
    autograd node where nothing else could see the calls, else by the separate calls."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("norm_and_rope takes both q_norm and k_norm, or neither")
    plain = all(type(t) in PLAIN_TENSORS for t in (q, k, cos, sin))
    if not (plain and _norm_of(q_norm) and _norm_of(k_norm) and not observed()):
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
    norms = None if q_norm is None else tuple((float(n.eps), n.group, n.replicas) for n in (q_norm, k_norm))
    _GROUPED[0] += 1
    return apply_function(_NormAndRope, q, k, None if q_norm is None else q_norm.weight,
                          None if k_norm is None else k_norm.weight, cos, sin, norms)
