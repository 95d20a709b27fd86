"""Rollout-vs-trainer mismatch metrics and the reproducibility metrics of the TBIK paper.

These are reports, not invariant paths: they run in float64 with ordinary torch reductions.
Definitions and where they come from:

- ``token_mult_prob_error`` (NeMo-RL): with ``g_i`` the generation log-probs, ``p_i`` the
  policy (training) log-probs and ``m_i`` the valid-token mask,
  ``sum_i m_i * exp(|g_i - p_i|) / sum_i m_i``.  1.0 means identical; NeMo-RL treats values
  above about 1.05 as a framework problem.
- ``k3_kl`` (slime's mismatch metric, Schulman's k3 estimator): with
  ``log_ratio = train_lp - rollout_lp``, the valid-token mean of
  ``exp(log_ratio) - log_ratio - 1``, an estimate of KL(pi_rollout || pi_train) from tokens
  sampled by the rollout engine.  0 means identical.
- ``count_unique_outputs`` (TBIK paper, Sec. 5.1): for one prompt generated under K runtime
  configurations, ``U = |unique({y_1, ..., y_K})|`` over the generated token sequences; 1 means
  the same output in every configuration.
- ``max_probability_divergence`` (TBIK paper, Sec. 5.1): at generated position ``i`` take each
  configuration's top-5 predictive probabilities (sorted descending); ``Delta_i`` is the largest,
  over the five ranks, of (max over configurations - min over configurations) of that rank's
  probability; the metric is the mean of ``Delta_i`` over positions ``1..L`` (``L`` = the
  shortest generation among the configurations).  0 means the top-5 distributions are bitwise
  identical at every position.  The paper states this in one sentence; the rank-wise spread is
  this module's reading of "maximum divergence of the top-5 predictive probabilities".
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from tpinv.layers.linear_cross_entropy import LOG_PROB_CHUNK_TOKENS

__all__ = ["count_unique_outputs", "fraction_bitwise_equal", "k3_kl", "max_abs_logprob_diff",
           "max_probability_divergence", "mismatch_metrics", "token_mult_prob_error", "trainer_log_probs"]


def _pair(gen_lp: torch.Tensor, train_lp: torch.Tensor, mask: Optional[torch.Tensor]):
    if gen_lp.shape != train_lp.shape:
        raise ValueError(f"generation and training log-probs must have one shape, got {list(gen_lp.shape)} and "
                         f"{list(train_lp.shape)}")
    if mask is None:
        mask = torch.ones(gen_lp.shape, dtype=torch.bool)
    elif mask.shape != gen_lp.shape:
        raise ValueError(f"mask must have the log-probs' shape {list(gen_lp.shape)}, got {list(mask.shape)}")
    mask = mask.bool()
    if not bool(mask.any()):
        raise ValueError("no valid tokens: the mask is all False")
    return gen_lp.double()[mask], train_lp.double()[mask]


def _mean(values: torch.Tensor) -> float:
    """The sum divided by the count on the host: exactly 1.0 for all ones and 0.0 for all zeros.
    (On CUDA, ``mean`` and division by a Python number multiply by a rounded ``1 / n``, so the
    mean of n ones is 0.9999999999999999 for some n: 49, 98, 103, ...)"""
    return float(values.sum()) / values.numel()


def token_mult_prob_error(gen_lp: torch.Tensor, train_lp: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
    """NeMo-RL's mean over valid tokens of ``exp(|gen_lp - train_lp|)``."""
    g, p = _pair(gen_lp, train_lp, mask)
    return _mean(torch.exp((g - p).abs()))


def k3_kl(gen_lp: torch.Tensor, train_lp: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
    """slime's K3 KL: mean over valid tokens of ``exp(r) - r - 1``, ``r = train_lp - gen_lp``."""
    g, p = _pair(gen_lp, train_lp, mask)
    r = p - g
    return _mean(torch.exp(r) - r - 1.0)


def max_abs_logprob_diff(gen_lp: torch.Tensor, train_lp: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
    g, p = _pair(gen_lp, train_lp, mask)
    return float((g - p).abs().max())


def fraction_bitwise_equal(gen_lp: torch.Tensor, train_lp: torch.Tensor,
                           mask: Optional[torch.Tensor] = None) -> float:
    """Fraction of valid tokens whose two fp32 log-probs have identical bits."""
    if gen_lp.dtype != torch.float32 or train_lp.dtype != torch.float32:
        raise TypeError(f"bitwise comparison needs fp32 log-probs, got {gen_lp.dtype} and {train_lp.dtype}")
    same = gen_lp.view(torch.int32) == train_lp.view(torch.int32)
    valid = torch.ones_like(same) if mask is None else mask.bool()
    _pair(gen_lp, train_lp, valid)
    return _mean(same[valid].double())


def mismatch_metrics(gen_lp: torch.Tensor, train_lp: torch.Tensor, mask: Optional[torch.Tensor] = None) -> dict:
    """All four rollout-vs-trainer metrics, plus the token count."""
    return {"tokens": int(gen_lp.numel() if mask is None else mask.bool().sum()),
            "token_mult_prob_error": token_mult_prob_error(gen_lp, train_lp, mask),
            "k3_kl": k3_kl(gen_lp, train_lp, mask),
            "max_abs_logprob_diff": max_abs_logprob_diff(gen_lp, train_lp, mask),
            "fraction_bitwise_equal": fraction_bitwise_equal(gen_lp, train_lp, mask)}


def count_unique_outputs(outputs: Sequence[Sequence[int]]) -> int:
    """The TBIK paper's U: distinct generated token sequences of one prompt across configurations."""
    if not outputs:
        raise ValueError("expected the outputs of at least one configuration")
    return len({tuple(int(t) for t in y) for y in outputs})


def max_probability_divergence(top_probs: Sequence[torch.Tensor], top: int = 5) -> float:
    """The TBIK paper's maximum probability divergence of one prompt across configurations.

    ``top_probs[k]``: configuration ``k``'s top probabilities ``[positions, >= top]``, each row
    sorted descending.  Returns the mean over the common positions of ``Delta_i`` (module
    docstring); 0.0 exactly when every configuration's top-``top`` rows are bitwise equal.
    """
    if not top_probs:
        raise ValueError("expected the top probabilities of at least one configuration")
    for t in top_probs:
        if t.dim() != 2 or t.shape[1] < top:
            raise ValueError(f"each entry must have shape [positions, >= {top}], got {list(t.shape)}")
    n = min(t.shape[0] for t in top_probs)
    if n == 0:
        return 0.0
    stack = torch.stack([t[:n, :top].double() for t in top_probs])        # [K, n, top]
    spread = stack.amax(dim=0) - stack.amin(dim=0)                         # [n, top]
    return _mean(spread.amax(dim=1))


def trainer_log_probs(model, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                      vanilla: bool = False, chunk_tokens: Optional[int] = LOG_PROB_CHUNK_TOKENS
                      ) -> list[torch.Tensor]:
    """The training forward's log-probs of each ``(prompt_ids, generated_ids)``'s generated tokens.

    One full-sequence forward without a cache over all sequences, right-padded:
    :meth:`~tpinv.models.Transformer.log_probs`, or with ``vanilla`` the plain control
    (:func:`~tpinv.models.vanilla.vanilla_forward` with the logits gathered, then
    ``torch.log_softmax``, as an FSDP/HF trainer computes it).  The log-prob of generated token
    ``j`` is read at position ``len(prompt) + j - 1``.  Returns fp32 ``[len(generated)]`` per
    sequence.  Call it on every rank of the model's group.  ``chunk_tokens``: the output layer runs
    that many tokens at a time (the same bits; ``None``: all at once).
    """
    from tpinv.models.vanilla import vanilla_forward
    rows = [list(p) + list(g) for p, g in sequences]
    if not rows or any(len(g) == 0 or len(p) == 0 for p, g in sequences):
        raise ValueError("expected at least one sequence, each with a non-empty prompt and generation")
    width = max(len(r) for r in rows)
    padded = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        padded[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    tokens, targets = padded[:, :-1], padded[:, 1:]
    with torch.no_grad():
        if vanilla:
            logits = vanilla_forward(model, tokens, gather_logits=True).float()
            lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
        else:
            lp = model.log_probs(tokens, targets, chunk_tokens=chunk_tokens)
    return [lp[i, len(p) - 1:len(p) - 1 + len(g)].detach().clone() for i, (p, g) in enumerate(sequences)]
