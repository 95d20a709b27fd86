"""``tpinv::attention``: invariant attention as a torch.library custom op, with autograd.

The CPU kernels (:mod:`tpinv.kernels.reference_attention`, :mod:`tpinv.kernels.reference_attention_bwd`)
fix every reduction order, so a query's output, log-sum-exp and gradients are the same
bits in prefill, chunked prefill and decode, at any batch size and padding.  On CUDA the
slots hold the Triton kernels of :mod:`tpinv.kernels.triton_attention` and
:mod:`tpinv.kernels.triton_attention_bwd` (named in the op definitions below), which
fix their own orders: a CUDA tensor never reaches SDPA.

``tpinv::attention_backward`` is an op of its own so the backward traces under
torch.compile / fake tensors too; it has no autograd formula (no double backward).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tpinv.kernels.reference_attention import attention_forward, block_visibility, check_attention_inputs
from tpinv.kernels.reference_attention_bwd import attention_backward
from tpinv.ops.attention_packed import attention_packed
from tpinv.ops.registry import define_op, register_fake

#: which keys a query sees (causal, window, mask): the rule every attention kernel applies,
#: re-exported for code above the ops (the vanilla control) that builds its own mask.
__all__ = ["attention", "attention_op", "attention_backward_op", "block_visibility"]


def _check_attention(q, k, v, q_pos, mask, causal, window, scale) -> None:
    check_attention_inputs(q, k, v, q_pos, mask, causal, window)


def _check_attention_backward(grad_out, grad_lse, q, k, v, out, lse, q_pos, mask, causal, window,
                              scale) -> None:
    check_attention_inputs(q, k, v, q_pos, mask, causal, window)


@define_op("attention", cuda="triton_attention.attention_forward_cuda", check=_check_attention,
           outputs_like=("q", None))
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                 mask: Optional[torch.Tensor], causal: bool, window: Optional[int],
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, S, D] in q.dtype, lse [B, Hq, S] fp32)``; see :func:`attention`."""
    return attention_forward(q, k, v, q_pos, mask, causal, window, scale)


@define_op("attention_backward", cuda="triton_attention_bwd.attention_backward_cuda",
           check=_check_attention_backward, outputs_like=("q", "k", "v"))
def attention_backward_op(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor],
                          q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, q_pos: torch.Tensor, mask: Optional[torch.Tensor],
                          causal: bool, window: Optional[int],
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`attention_op`, in the dtypes of ``q, k, v``."""
    return attention_backward(grad_out, grad_lse, q, k, v, out, lse, q_pos, mask, causal,
                              window, scale)


@register_fake(attention_op)
def _attention_fake(q, k, v, q_pos, mask, causal, window, scale):
    B, Hq, S, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, Hq, S), dtype=torch.float32)


@register_fake(attention_backward_op)
def _attention_backward_fake(grad_out, grad_lse, q, k, v, out, lse, q_pos, mask, causal, window,
                             scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_pos, mask, causal, window, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_pos, mask)
    ctx.causal, ctx.window, ctx.scale = causal, window, scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, q_pos, mask = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = attention_backward_op(grad_out, grad_lse, q, k, v, out, lse, q_pos, mask,
                                       ctx.causal, ctx.window, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, *,
              causal: bool = True, window: Optional[int] = None,
              mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
              k_pos: Optional[torch.Tensor] = None, return_lse: bool = False):
    """Batch-, chunk- and padding-invariant attention (GQA, causal, sliding window, mask).

    ``q [B, Hq, S, D]``, ``k, v [B, Hkv, T, D]`` share one dtype (fp32/bf16/fp16),
    ``Hq = g * Hkv`` (query head ``h`` reads kv head ``h // g``); key slot ``j`` holds
    absolute position ``j``; ``q_pos`` int64 ``[B, S]`` is each query's position.  Key
    ``j`` is visible to a query at ``p`` when ``j <= p`` (``causal``), ``j > p - window``
    (``window``) and ``mask[b, i, j]`` (bool ``[B, S, T]``, True = may attend).  A query
    that sees no key returns zeros.  ``scale`` defaults to ``1/sqrt(D)``.

    Returns ``out [B, Hq, S, D]`` in q's dtype, or ``(out, lse)`` with the fp32
    log-sum-exp ``[B, Hq, S]`` when ``return_lse``.  Differentiable in q, k, v (and
    through ``lse``).

    ``k_pos`` int64 ``[B, T]`` gives key slot ``j`` the position ``k_pos[:, j]`` instead
    (packed rows): causality, window and the key-block grid then follow positions, so a
    document packed anywhere in a row gets the bits it gets alone (``tpinv::attention_packed``).
    """
    if scale is None:  # the op checks the inputs; a shape-less q reaches that check with scale 1
        dim = q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() else 1
        scale = 1.0 / math.sqrt(dim) if dim else 1.0
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if k_pos is not None:
        out, lse = attention_packed(q, k, v, q_pos, k_pos, causal=bool(causal), window=window,
                                    mask=mask, scale=scale)
    else:
        out, lse = attention_op(q, k, v, q_pos, mask, bool(causal), window, scale)
    return (out, lse) if return_lse else out
