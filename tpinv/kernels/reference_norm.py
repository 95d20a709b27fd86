"""Invariant RMSNorm on CPU: one fixed order for the hidden sum and the token sum.

Forward (Hugging Face Llama/Qwen3 semantics)::

    n = x_f32 * rsqrt(sum(x_f32 * x_f32) / H + eps)      # per row
    y = (n.to(x.dtype).f32 * weight.f32).to(out_dtype)  # out_dtype = promote(x, weight)

The sum over the hidden dimension (never split by tensor parallelism) is the fixed
chain ``leaf_tree_sum(., 1)``; the mean is that sum divided by ``H`` in a single
correctly rounded division (not a multiplication by ``1/H``).  The product of two
16-bit floats is exact in fp32, so ``n_dt * weight`` rounded once equals PyTorch's own
``weight * n.to(x.dtype)``.

Backward (the cast of ``n`` to ``x.dtype`` is passed straight through)::

    g_n = grad_f32 * weight_f32
    dx  = g_n * r - x_f32 * (((r * r) * r) * sum_h(g_n * x_f32) / H)
    dw  = sum_tokens(grad_f32 * n_dt_f32)

``sum_h`` is ``leaf_tree_sum(., 1)`` over the hidden dimension of each row; ``sum_tokens``
is ``leaf_tree_sum(., 1)`` over the flattened leading (token) dimensions, so a row's
``y`` and ``dx`` depend only on that row, and ``dw`` depends only on the token values in
their order -- appending zero-gradient padding tokens leaves it unchanged.
"""
from __future__ import annotations

import torch

from tpinv.core.contract import InvarianceError, check_dtype
from tpinv.kernels.reference_tree import leaf_tree_sum


def check_rms_norm_inputs(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Raise a clear error for inputs :func:`rms_norm_forward` does not accept."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("rms_norm expects tensors x [..., H] and weight [H]")
    check_dtype(x.dtype, "rms_norm input x")
    check_dtype(weight.dtype, "rms_norm weight")
    if x.dim() < 1:
        raise InvarianceError(f"rms_norm input must have shape [..., H], got a {x.dim()}-d tensor")
    hidden = x.shape[-1]
    if tuple(weight.shape) != (hidden,):
        raise InvarianceError(
            f"rms_norm weight must have shape ({hidden},) to match x of shape {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}")
    if hidden == 0:
        raise InvarianceError("rms_norm needs a non-empty hidden dimension")
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"rms_norm eps must be a non-negative float, got {eps!r}")


def check_rms_norm_backward_inputs(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                   eps: float) -> None:
    check_rms_norm_inputs(x, weight, eps)
    if grad.shape != x.shape:
        raise InvarianceError(
            f"rms_norm grad must have the output shape {tuple(x.shape)}, got {tuple(grad.shape)}")


def rms_norm_out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The output dtype: PyTorch's promotion of ``x.dtype`` and ``weight.dtype`` (as HF)."""
    return torch.promote_types(x.dtype, weight.dtype)


def rms_reciprocal(x_f32: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row ``rsqrt(mean(x^2) + eps)`` of an fp32 ``[..., H]`` tensor, shape ``[..., 1]``."""
    hidden = x_f32.shape[-1]
    mean_square = leaf_tree_sum(x_f32 * x_f32, 1) / hidden
    return torch.rsqrt(mean_square + eps).unsqueeze(-1)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim, fixed order."""
    check_rms_norm_inputs(x, weight, eps)
    x_f32 = x.to(torch.float32)
    normed = (x_f32 * rms_reciprocal(x_f32, eps)).to(x.dtype)
    out = normed.to(torch.float32) * weight.to(torch.float32)
    return out.to(rms_norm_out_dtype(x, weight))


def _sum_over_tokens(values: torch.Tensor) -> torch.Tensor:
    """Fixed-order sum of ``[..., H]`` over every leading dim: ``[H]`` (fp32)."""
    flat = values.reshape(-1, values.shape[-1])
    return leaf_tree_sum(flat.transpose(0, 1), 1)


def sum_over_tokens_per_head(values: torch.Tensor) -> torch.Tensor:
    """Fixed-order sum of ``[..., heads, H]`` over every leading dim: ``[heads, H]`` (fp32).

    Each head's sum is the one :func:`_sum_over_tokens` gives for that head's slice alone
    (the same contiguous halving over tokens, batched over heads by exact elementwise adds).
    """
    flat = values.reshape(-1, values.shape[-2], values.shape[-1])
    return leaf_tree_sum(flat.permute(1, 2, 0), 1)


def check_per_head_inputs(x: torch.Tensor) -> None:
    if x.dim() < 2:
        raise InvarianceError(f"rms_norm_backward_heads needs x of shape [..., heads, H], got "
                              f"{tuple(x.shape)}")


def rms_norm_backward_heads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight per head [heads, H])`` for ``x [..., heads, H]`` sharing one ``weight``.

    Row ``h`` of the weight gradient has the bits :func:`rms_norm_backward` gives for the
    slice ``x[..., h, :]`` alone, so heads may be summed later in a fixed global order.
    """
    check_rms_norm_backward_inputs(grad, x, weight, eps)
    check_per_head_inputs(x)
    return _backward(grad, x, weight, eps, sum_over_tokens_per_head)


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of :func:`rms_norm_forward`, in ``x.dtype`` and ``weight.dtype``."""
    check_rms_norm_backward_inputs(grad, x, weight, eps)
    return _backward(grad, x, weight, eps, _sum_over_tokens)


def _backward(grad, x, weight, eps, token_sum):
    hidden = x.shape[-1]
    x_f32 = x.to(torch.float32)
    grad_f32 = grad.to(torch.float32)
    r = rms_reciprocal(x_f32, eps)
    normed = (x_f32 * r).to(x.dtype).to(torch.float32)
    grad_weight = token_sum(grad_f32 * normed).to(weight.dtype)
    grad_normed = grad_f32 * weight.to(torch.float32)
    dot = leaf_tree_sum(grad_normed * x_f32, 1).unsqueeze(-1)
    coeff = (((r * r) * r) * dot) / hidden
    grad_x = (grad_normed * r - x_f32 * coeff).to(x.dtype)
    return grad_x, grad_weight
