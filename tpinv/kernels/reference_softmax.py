"""Invariant softmax, log-softmax and logsumexp over the last dim, and their split pieces.

The last dimension may be a vocabulary that tensor parallelism splits, so its one sum
follows the contract: the row max ``m`` is exact in any order (``torch.amax``); the sum
``s = leaf_tree_sum(exp(x - m), leaves)`` uses ``leaves`` equal contiguous leaves and
the balanced leaf tree; the log is taken once.  In fp32, then rounded once::

    softmax     = exp(x - m) / s
    log_softmax = (x - m) - log(s)
    logsumexp   = m + log(s)

A row whose max is infinite is shifted by 0 instead of ``m`` (so an all ``-inf`` row gives
``logsumexp = -inf`` as in PyTorch).

How the pieces compose when the last dim is split over a group of ``C`` ranks (``C``
divides ``leaves``; rank ``r`` holds the contiguous slice ``r`` of the row):

1. ``m`` = max over ranks of ``x_local.amax(-1)`` (an all-reduce MAX: exact in any order);
2. ``p_r = sum_exp_partial(x_local, m, leaves // C)`` -- the fp32 sub-tree of rank ``r``'s
   leaves;
3. ``s = tree_combine(stack([p_0, ..., p_{C-1}], -1))`` (the top of the same tree, in rank
   order; a tree all-reduce does this across processes);
4. ``logsumexp_from_parts(m, s)``, ``log_softmax_from_parts(x_local, m, s)`` and
   ``softmax_from_parts(x_local, m, s)`` give exactly the bits of the unsplit ops (for the
   local slice), at every ``C``.

The backward passes recompute the fp32 softmax from ``x`` and reduce over the last dim
with the same ``leaves``, so they compose over a split vocabulary the same way.
"""
from __future__ import annotations

import torch

from tpinv.core.contract import InvarianceError, check_divisible, check_dtype, check_leaves
from tpinv.kernels.reference_tree import leaf_tree_sum


def check_softmax_inputs(x: torch.Tensor, leaves: int, name: str = "softmax") -> None:
    """Raise a clear error for inputs the softmax family does not accept."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} expects a tensor of shape [..., V], got {type(x).__name__}")
    check_dtype(x.dtype, f"{name} input")
    if x.dim() < 1:
        raise InvarianceError(f"{name} input must have shape [..., V], got a 0-d tensor")
    check_divisible(f"{name} last dimension", x.shape[-1], check_leaves(leaves))


def safe_shift(row_max: torch.Tensor) -> torch.Tensor:
    """The value subtracted before ``exp``: the row max where finite, else 0."""
    return torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)


def row_max(x: torch.Tensor) -> torch.Tensor:
    """Exact fp32 max of the last dim, shape ``x.shape[:-1]``."""
    return torch.amax(x.to(torch.float32), dim=-1)


def _shifted(x: torch.Tensor, max_: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32) - safe_shift(max_).unsqueeze(-1)


def sum_exp(x: torch.Tensor, max_: torch.Tensor, leaves: int) -> torch.Tensor:
    """fp32 ``leaf_tree_sum(exp(x - max), leaves)`` of the last dim, shape ``x.shape[:-1]``."""
    return leaf_tree_sum(torch.exp(_shifted(x, max_)), leaves)


def check_partial_inputs(x: torch.Tensor, max_: torch.Tensor, leaves: int) -> None:
    check_softmax_inputs(x, leaves, "sum_exp_partial")
    if not isinstance(max_, torch.Tensor) or max_.dtype != torch.float32:
        raise TypeError("sum_exp_partial max must be an fp32 tensor (the exact row max over "
                        f"all ranks), got {getattr(max_, 'dtype', type(max_).__name__)}")
    if tuple(max_.shape) != tuple(x.shape[:-1]):
        raise InvarianceError(
            f"sum_exp_partial max must have shape {tuple(x.shape[:-1])} (x.shape[:-1] for x of "
            f"shape {tuple(x.shape)}), got {tuple(max_.shape)}")


def sum_exp_partial(x: torch.Tensor, max_: torch.Tensor, leaves: int) -> torch.Tensor:
    """fp32 sub-tree partial of ``exp(x - max)`` over this rank's slice of the last dim.

    ``leaves`` is the number of leaves this rank owns (``L // C``); ``max_`` is the row
    max over the whole (unsplit) row.  See the module docstring for the composition.
    """
    check_partial_inputs(x, max_, leaves)
    return sum_exp(x, max_, leaves)


def _check_parts(max_: torch.Tensor, total: torch.Tensor) -> None:
    for name, t in (("max", max_), ("sum_exp", total)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} must be an fp32 tensor, got {getattr(t, 'dtype', t)}")
    if max_.shape != total.shape:
        raise InvarianceError(f"max and sum_exp must have the same shape, got "
                              f"{tuple(max_.shape)} and {tuple(total.shape)}")


def logsumexp_from_parts(max_: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """fp32 ``m + log(s)`` from the global row max and the combined sum of exponentials."""
    _check_parts(max_, total)
    return safe_shift(max_) + torch.log(total)


def log_softmax_from_parts(x: torch.Tensor, max_: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """fp32 ``(x - m) - log(s)`` for a (local slice) ``x`` of the row."""
    _check_parts(max_, total)
    return _shifted(x, max_) - torch.log(total).unsqueeze(-1)


def softmax_from_parts(x: torch.Tensor, max_: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """fp32 ``exp(x - m) / s`` for a (local slice) ``x`` of the row."""
    _check_parts(max_, total)
    return torch.exp(_shifted(x, max_)) / total.unsqueeze(-1)


def _max_and_sum(x: torch.Tensor, leaves: int) -> tuple[torch.Tensor, torch.Tensor]:
    max_ = row_max(x)
    return max_, sum_exp(x, max_, leaves)


def softmax_forward(x: torch.Tensor, leaves: int) -> torch.Tensor:
    check_softmax_inputs(x, leaves, "softmax")
    return softmax_from_parts(x, *_max_and_sum(x, leaves)).to(x.dtype)


def log_softmax_forward(x: torch.Tensor, leaves: int) -> torch.Tensor:
    check_softmax_inputs(x, leaves, "log_softmax")
    return log_softmax_from_parts(x, *_max_and_sum(x, leaves)).to(x.dtype)


def logsumexp_forward(x: torch.Tensor, leaves: int) -> torch.Tensor:
    check_softmax_inputs(x, leaves, "logsumexp")
    return logsumexp_from_parts(*_max_and_sum(x, leaves)).to(x.dtype)


def _check_grad(grad: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if tuple(grad.shape) != tuple(shape):
        raise InvarianceError(f"{name} grad must have shape {tuple(shape)}, got {tuple(grad.shape)}")
    return grad.to(torch.float32)


def softmax_backward(grad: torch.Tensor, x: torch.Tensor, leaves: int) -> torch.Tensor:
    """``y * (g - sum(g * y))`` with ``y`` the fp32 softmax recomputed from ``x``."""
    check_softmax_inputs(x, leaves, "softmax")
    g = _check_grad(grad, x.shape, "softmax")
    y = softmax_from_parts(x, *_max_and_sum(x, leaves))
    dot = leaf_tree_sum(g * y, leaves).unsqueeze(-1)
    return (y * (g - dot)).to(x.dtype)


def log_softmax_backward(grad: torch.Tensor, x: torch.Tensor, leaves: int) -> torch.Tensor:
    """``g - softmax(x) * sum(g)`` with the fp32 softmax recomputed from ``x``."""
    check_softmax_inputs(x, leaves, "log_softmax")
    g = _check_grad(grad, x.shape, "log_softmax")
    y = softmax_from_parts(x, *_max_and_sum(x, leaves))
    total_grad = leaf_tree_sum(g, leaves).unsqueeze(-1)
    return (g - y * total_grad).to(x.dtype)


def logsumexp_backward(grad: torch.Tensor, x: torch.Tensor, leaves: int) -> torch.Tensor:
    """``g * softmax(x)`` with the fp32 softmax recomputed from ``x``."""
    check_softmax_inputs(x, leaves, "logsumexp")
    g = _check_grad(grad, x.shape[:-1], "logsumexp")
    y = softmax_from_parts(x, *_max_and_sum(x, leaves))
    return (g.unsqueeze(-1) * y).to(x.dtype)
