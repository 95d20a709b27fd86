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
runs the forward with each query alone against its virtual row through ``tpinv::attention``
(one query per batch row: the same Triton bits of the query alone, slower), and its CUDA
backward raises ``NotImplementedError`` naming the case (never a silent fallback or a
gradient of another order).  Reached through :func:`tpinv.ops.attention` with ``k_pos``.
"""
from __future__ import annotations

from typing import Optional

import torch

from tpinv.kernels.packed_documents import documents_of
from tpinv.kernels.reference_attention import check_attention_inputs
from tpinv.kernels.reference_attention_packed import (check_key_positions, packed_attention_backward,
                                                      packed_attention_forward, virtual_slots, visible)
from tpinv.ops.registry import define_op, register_fake

#: which keys a packed query sees (positions, causal, window, mask), for code above the ops (the
#: vanilla control) that builds its own mask.
packed_visible = visible

__all__ = ["attention_packed_op", "attention_packed_backward_op", "packed_visible", "packed_forward_by_rows",
           "packed_forward_cuda", "packed_backward_cuda"]


def _check_packed(q, k, v, q_pos, k_pos, mask, causal, window, scale) -> None:
    check_attention_inputs(q, k, v, q_pos, mask, causal, window)
    check_key_positions(k_pos, k)


def _check_packed_backward(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos, mask, causal, window,
                           scale) -> None:
    _check_packed(q, k, v, q_pos, k_pos, mask, causal, window, scale)


def packed_forward_by_rows(q, k, v, q_pos, k_pos, mask, causal, window, scale, *, max_rows: int = 4096):
    """The packed forward through ``tpinv::attention``: each query alone against its virtual row."""
    _check_packed(q, k, v, q_pos, k_pos, mask, causal, window, scale)  # this CUDA kernel's entry check
    from tpinv.ops.attention import attention_op  # the module that imports this one
    B, Hq, S, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    for b in range(B):
        slots = virtual_slots(visible(q_pos[b], k_pos[b], None if mask is None else mask[b], causal, window),
                              k_pos[b])
        for s0 in range(0, S, max_rows):
            sl = slots[s0:s0 + max_rows]
            idx = sl.clamp(min=0)
            k_v = k[b][:, idx].permute(1, 0, 2, 3).contiguous()  # [n, Hkv, Tv, D]
            v_v = v[b][:, idx].permute(1, 0, 2, 3).contiguous()
            q_r = q[b, :, s0:s0 + max_rows].permute(1, 0, 2)[:, :, None].contiguous()  # [n, Hq, 1, D]
            o, l = attention_op(q_r, k_v, v_v, q_pos[b, s0:s0 + max_rows, None].contiguous(),
                                (sl >= 0)[:, None].contiguous(), causal, window, scale)
            out[b, :, s0:s0 + max_rows] = o[:, :, 0].permute(1, 0, 2)
            lse[b, :, s0:s0 + max_rows] = l[:, :, 0].permute(1, 0)
    return out, lse


def packed_forward_cuda(q, k, v, q_pos, k_pos, mask, causal, window, scale):
    """The CUDA forward: per-document rows by documents, any other visibility by rows."""
    _check_packed(q, k, v, q_pos, k_pos, mask, causal, window, scale)
    docs = documents_of(q_pos, k_pos, mask, causal, window)
    if docs is None:
        return packed_forward_by_rows(q, k, v, q_pos, k_pos, mask, causal, window, scale)
    from tpinv.kernels.triton_attention_packed import documents_forward_cuda
    return documents_forward_cuda(docs, q, k, v, causal, window, scale)


def packed_backward_cuda(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos, mask, causal, window, scale):
    """The CUDA backward: per-document rows only (see the module docstring)."""
    _check_packed_backward(grad_out, grad_lse, q, k, v, out, lse, q_pos, k_pos, mask, causal, window, scale)
    docs = documents_of(q_pos, k_pos, mask, causal, window)
    if docs is None:
        raise NotImplementedError(
            "tpinv::attention_packed_backward on CUDA needs per-document visibility: every query "
            "seeing the causal/window part of one run of keys at positions 0..L-1 (a document); "
            "here some query sees keys of several runs or part of one (a general 2D mask such as "
            "multi-turn with dropped reasoning), whose backward runs on CPU only")
    from tpinv.kernels.triton_attention_packed import documents_backward_cuda
    return documents_backward_cuda(docs, grad_out, grad_lse, q, k, v, out, lse, causal, window, scale)


@define_op("attention_packed", cuda=packed_forward_cuda, check=_check_packed)
def attention_packed_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        k_pos: torch.Tensor, mask: Optional[torch.Tensor], causal: bool,
                        window: Optional[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, S, D] in q.dtype, lse [B, Hq, S] fp32)`` with key ``j`` at ``k_pos[:, j]``."""
    return packed_attention_forward(q, k, v, q_pos, k_pos, mask, causal, window, scale)


@define_op("attention_packed_backward", cuda=packed_backward_cuda, check=_check_packed_backward)
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
