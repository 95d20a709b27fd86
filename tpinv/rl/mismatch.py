"""Rollout-vs-trainer mismatch corrections (slime's TIS / MIS family) as plain functions.

A vanilla trainer scores the rollout's tokens with log-probs ``train_lp`` that differ from
the engine's ``rollout_lp``; the standard remedy weights each token's loss by the importance
ratio ``pi_train / pi_rollout`` and bounds it.  Everything here works on ``[B, T]`` fp32
log-probs with a bool ``mask`` of valid (response) tokens:

* :func:`importance_weights` at ``token`` level (``exp(train - rollout)`` per token),
  ``sequence`` level (the product over the sequence's valid tokens) or ``geometric`` level
  (the geometric mean over them), broadcast to the sequence's tokens;
* :func:`truncate` (TIS: cap at ``upper``), :func:`clip` (keep in ``[lower, upper]``),
  :func:`reject` (MIS / rejection sampling: drop tokens -- or whole sequences -- whose weight
  leaves ``[lower, upper]``), :func:`veto` (drop a sequence holding a token whose trainer
  probability is below a threshold), :func:`batch_normalize` (valid weights average to 1);
* :func:`correct` chains them.

When trainer and rollout log-probs are the same bits -- tpinv's invariant path -- every log
ratio is exactly 0, every weight exactly 1.0 and nothing is clipped, rejected or vetoed: the
corrections are the identity (``tests/unit/test_rl_mismatch.py`` checks this bitwise).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["LEVELS", "importance_weights", "truncate", "clip", "reject", "veto", "batch_normalize", "correct"]

LEVELS = ("token", "sequence", "geometric")


def _check(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    if train_lp.shape != rollout_lp.shape or train_lp.dim() != 2:
        raise ValueError(f"train_lp and rollout_lp must share one [B, T] shape, got {list(train_lp.shape)} "
                         f"and {list(rollout_lp.shape)}")
    if mask is None:
        return torch.ones(train_lp.shape, dtype=torch.bool, device=train_lp.device)
    if mask.dtype != torch.bool or mask.shape != train_lp.shape:
        raise ValueError(f"mask must be bool of shape {list(train_lp.shape)}, got {mask.dtype} {list(mask.shape)}")
    return mask


def importance_weights(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: Optional[torch.Tensor] = None,
                       level: str = "token") -> torch.Tensor:
    """``[B, T]`` fp32 weights ``pi_train / pi_rollout`` at ``level``; 0 on invalid tokens."""
    mask = _check(train_lp, rollout_lp, mask)
    if level not in LEVELS:
        raise ValueError(f"level={level!r}: expected one of {LEVELS}")
    log_ratio = torch.where(mask, train_lp.float() - rollout_lp.float(), 0.0)
    if level == "token":
        w = torch.exp(log_ratio)
    else:
        total = log_ratio.sum(-1, keepdim=True)
        if level == "geometric":
            total = total / mask.sum(-1, keepdim=True).clamp(min=1)
        w = torch.exp(total).expand_as(log_ratio)
    return torch.where(mask, w, 0.0)


def truncate(weights: torch.Tensor, upper: float) -> torch.Tensor:
    """TIS: ``min(w, upper)``."""
    return weights.clamp(max=upper)


def clip(weights: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """``w`` clamped into ``[lower, upper]``."""
    if not lower <= upper:
        raise ValueError(f"clip needs lower <= upper, got [{lower}, {upper}]")
    return weights.clamp(min=lower, max=upper)


def reject(weights: torch.Tensor, mask: torch.Tensor, lower: float, upper: float, *,
           whole_sequence: bool = False) -> torch.Tensor:
    """MIS / rejection sampling: the mask without tokens whose weight leaves ``[lower, upper]``
    (without their whole sequence when ``whole_sequence``)."""
    outside = mask & ((weights < lower) | (weights > upper))
    if whole_sequence:
        return mask & ~outside.any(-1, keepdim=True)
    return mask & ~outside


def veto(train_lp: torch.Tensor, mask: torch.Tensor, threshold: float = 1e-6) -> torch.Tensor:
    """Catastrophic-token veto: drop every sequence holding a valid token with ``p < threshold``."""
    bad = mask & (train_lp.float() < torch.log(torch.tensor(threshold, dtype=torch.float32)))
    return mask & ~bad.any(-1, keepdim=True)


def batch_normalize(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Self-normalisation: weights divided by their mean over the batch's valid tokens."""
    n = int(mask.sum())
    if n == 0:
        return weights
    mean = torch.where(mask, weights, 0.0).sum() / n
    return torch.where(mask, weights / mean, 0.0)


def correct(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: Optional[torch.Tensor] = None, *,
            level: str = "token", mode: Optional[str] = "truncate", lower: float = 0.5, upper: float = 2.0,
            veto_threshold: Optional[float] = None, normalize: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, mask)``: importance weights at ``level``, then ``mode`` (``truncate``, ``clip``,
    ``mask`` -- rejection --, or None), the veto, and batch normalisation, in that order."""
    mask = _check(train_lp, rollout_lp, mask)
    w = importance_weights(train_lp, rollout_lp, mask, level)
    if mode == "truncate":
        w = truncate(w, upper)
    elif mode == "clip":
        w = clip(w, lower, upper)
    elif mode == "mask":
        mask = reject(w, mask, lower, upper)
    elif mode is not None:
        raise ValueError(f"mode={mode!r}: expected 'truncate', 'clip', 'mask' or None")
    if veto_threshold is not None:
        mask = veto(train_lp, mask, veto_threshold)
    w = torch.where(mask, w, 0.0)
    if normalize:
        w = batch_normalize(w, mask)
    return w, mask
