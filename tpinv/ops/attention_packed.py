"""``tpinv::attention_packed``: invariant attention whose key-block grid follows key positions.

The CPU kernels (:mod:`tpinv.kernels.reference_attention_packed`) place each key a query
sees at the slot of its own position, so a document packed at any offset of a row, or a
turn of a conversation packed with a 2D visibility mask, gets the bits of the same tokens
alone, forward and backward.  The CUDA slot has no kernel yet: a CUDA tensor raises
(never a silent fallback).  Reached through :func:`tpinv.ops.attention` with ``k_pos``.
"""
from __future__ import annotations

from typing import Optional

import torch

from tpinv.kernels.reference_attention import check_attention_inputs
from tpinv.kernels.reference_attention_packed import (check_key_positions, packed_attention_backward,
                                                      packed_attention_forward)
from tpinv.ops.registry import define_op

__all__ = ["attention_packed_op", "attention_packed_backward_op"]


@define_op("attention_packed")
def attention_packed_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        k_pos: torch.Tensor, mask: Optional[torch.Tensor], causal: bool,
                        window: Optional[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, S, D] in q.dtype, lse [B, Hq, S] fp32)`` with key ``j`` at ``k_pos[:, j]``."""
    return packed_attention_forward(q, k, v, q_pos, k_pos, mask, causal, window, scale)


@define_op("attention_packed_backward")
def attention_packed_backward_op(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor],
                                 q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                 lse: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                                 mask: Optional[torch.Tensor], causal: bool, window: Optional[int],
                                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`attention_packed_op`."""
    return packed_attention_backward(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos, mask,
                                     causal, window, scale)


@attention_packed_op.register_fake
def _fake(q, k, v, q_pos, k_pos, mask, causal, window, scale):
    check_attention_inputs(q, k, v, q_pos, mask, causal, window)
    B, Hq, S, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, Hq, S), dtype=torch.float32)


@attention_packed_backward_op.register_fake
def _backward_fake(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos, mask, causal, window, scale):
    check_attention_inputs(q, k, v, q_pos, mask, causal, window)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_pos, k_pos, mask, causal, window, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos, mask)
    ctx.causal, ctx.window, ctx.scale = causal, window, scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, q_pos, k_pos, mask = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = attention_packed_backward_op(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos,
                                              mask, ctx.causal, ctx.window, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None


attention_packed_op.register_autograd(_backward, setup_context=_setup_context)


def attention_packed(q, k, v, q_pos, k_pos, *, causal, window, mask, scale):
    """Checked entry used by :func:`tpinv.ops.attention` when ``k_pos`` is given."""
    check_key_positions(k_pos, k)
    return attention_packed_op(q, k, v, q_pos, k_pos, mask, causal, window, scale)
