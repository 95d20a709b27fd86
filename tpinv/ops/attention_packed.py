"""``tpinv::attention_packed``: invariant attention whose key-block grid follows key positions.

The CPU kernels (:mod:`tpinv.kernels.reference_attention_packed`) place each key a query
sees at the slot of its own position, so a document packed at any offset of a row, or a
turn of a conversation packed with a 2D visibility mask, gets the bits of the same tokens
alone, forward and backward.  On CUDA, rows whose visibility is per-document (every query
sees the causal/window part of one run of keys at positions ``0 .. L-1``:
:mod:`tpinv.kernels.packed_documents`) run each document alone in a padded batch of the
Triton kernels (:mod:`tpinv.kernels.triton_attention_packed`), forward and backward, so a
packed document gets the Triton bits of the same document through ``tpinv::attention``
alone.  Any other visibility (a general 2D mask, e.g. multi-turn with dropped reasoning)
runs each query alone as one batch row of the same Triton kernels against its virtual row
(:mod:`tpinv.kernels.triton_attention_packed_rows`): ``out``, ``lse`` and ``dq`` of a query
are the Triton bits of the query in its own context alone, and a key's ``dk``/``dv`` add the
queries' contributions in fp32 by halving over the virtual query axis (the CPU backward's
order of queries), so they do not depend on where the row was packed, the batch or TP.
Reached through :func:`tpinv.ops.attention` with ``k_pos``.
"""
from __future__ import annotations

from typing import Optional

import torch

from tpinv.kernels.packed_documents import documents_of
from tpinv.kernels.reference_attention import check_attention_inputs
from tpinv.kernels.reference_attention_packed import (check_key_positions, packed_attention_backward,
                                                      packed_attention_forward, visible)
from tpinv.ops.registry import define_op, register_fake

#: which keys a packed query sees (positions, causal, window, mask), for code above the ops (the
#: vanilla control) that builds its own mask.
packed_visible = visible

__all__ = ["attention_packed_op", "attention_packed_backward_op", "packed_visible", "packed_forward_cuda",
           "packed_backward_cuda"]


def _check_packed(q, k, v, q_pos, k_pos, mask, causal, window, scale) -> None:
    check_attention_inputs(q, k, v, q_pos, mask, causal, window)
    check_key_positions(k_pos, k)


def _check_packed_backward(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos, mask, causal, window,
                           scale) -> None:
    _check_packed(q, k, v, q_pos, k_pos, mask, causal, window, scale)


def packed_forward_cuda(q, k, v, q_pos, k_pos, mask, causal, window, scale):
    """The CUDA forward: per-document rows by documents, any other visibility by rows."""
    _check_packed(q, k, v, q_pos, k_pos, mask, causal, window, scale)
    docs = documents_of(q_pos, k_pos, mask, causal, window)
    if docs is None:
        from tpinv.kernels.triton_attention_packed_rows import rows_forward_cuda
        return rows_forward_cuda(q, k, v, q_pos, k_pos, mask, causal, window, scale)
    from tpinv.kernels.triton_attention_packed import documents_forward_cuda
    return documents_forward_cuda(docs, q, k, v, causal, window, scale)


def packed_backward_cuda(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos, mask, causal, window, scale):
    """The CUDA backward: per-document rows by documents, any other visibility by rows."""
    _check_packed_backward(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos, mask, causal, window, scale)
    docs = documents_of(q_pos, k_pos, mask, causal, window)
    if docs is None:
        from tpinv.kernels.triton_attention_packed_rows import rows_backward_cuda
        return rows_backward_cuda(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos, mask, causal, window,
                                  scale)
    from tpinv.kernels.triton_attention_packed import documents_backward_cuda
    return documents_backward_cuda(docs, grad_out, grad_lse, q, k, v, out, lse, causal, window, scale)


@define_op("attention_packed", cuda=packed_forward_cuda, check=_check_packed, outputs_like=("q", None))
def attention_packed_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        k_pos: torch.Tensor, mask: Optional[torch.Tensor], causal: bool,
                        window: Optional[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, S, D] in q.dtype, lse [B, Hq, S] fp32)`` with key ``j`` at ``k_pos[:, j]``."""
    return packed_attention_forward(q, k, v, q_pos, k_pos, mask, causal, window, scale)


@define_op("attention_packed_backward", cuda=packed_backward_cuda, check=_check_packed_backward,
           outputs_like=("q", "k", "v"))
def attention_packed_backward_op(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor],
                                 q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                 lse: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                                 mask: Optional[torch.Tensor], causal: bool, window: Optional[int],
                                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`attention_packed_op`."""
    return packed_attention_backward(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos, mask,
                                     causal, window, scale)


@register_fake(attention_packed_op)
def _fake(q, k, v, q_pos, k_pos, mask, causal, window, scale):
    B, Hq, S, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, Hq, S), dtype=torch.float32)


@register_fake(attention_packed_backward_op)
def _backward_fake(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos, mask, causal, window, scale):
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
    """The entry used by :func:`tpinv.ops.attention` when ``k_pos`` is given (the inputs are checked
    once, at the entry of the kernel that runs, or in the fake)."""
    return attention_packed_op(q, k, v, q_pos, k_pos, mask, causal, window, scale)
