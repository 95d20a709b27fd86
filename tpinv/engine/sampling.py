"""Token sampling whose result depends only on one request's logits row and its key.

The invariant this module keeps: the token drawn for a request at a position, and the
log-probabilities reported for it, are a function of (that request's full-vocabulary logits
row, its sampling parameters, ``(seed, request id, position)``) only -- never of the other
rows in the batch, the row's place in the batch, arrival order or TP size.

- Noise: one uniform number per ``(seed, request id, position)`` from a counter-based
  generator (SplitMix64 finalizers over Python integers, exact on every platform), used by
  inverse-CDF sampling.  No stateful generator is consumed, so nothing else in the batch
  can shift the stream.
- Order: every reduction over the vocabulary is fixed.  Log-probs are ``z - logsumexp(z)``
  with tpinv's ``logsumexp`` (contract leaf tree over ``leaves`` vocabulary leaves);
  candidates are ordered by (probability descending, token id ascending) with a stable sort
  (comparisons only);
  cumulative sums for top-p and for the inverse CDF use :func:`prefix_sum`, a fixed
  Hillis-Steele scan built from exact elementwise adds.

Two log-probabilities are reported for a drawn token (see :class:`SampleOutput`):
``raw`` comes from the engine (the model's unmodified ``log softmax(logits)``, the same
bits as :meth:`tpinv.models.Transformer.log_probs`); ``sampled`` is computed here, the
log-probability under the distribution actually sampled from, after temperature, top-k
and top-p (0.0 for greedy decoding, a point mass).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Callable, Optional, Sequence, Union

import torch

from tpinv.core.contract import DEFAULT_LEAVES
from tpinv.ops import logsumexp

__all__ = ["GREEDY_BELOW", "SamplingParams", "SampleOutput", "counter_uniform", "prefix_sum", "request_key",
           "sample_row", "sample_rows", "vocab_log_probs"]

#: A temperature below this is greedy decoding (the convention vLLM uses as well).
GREEDY_BELOW = 1e-5

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15

RequestId = Union[int, str]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request draws tokens.

    ``temperature`` 0 (or below :data:`GREEDY_BELOW`) means greedy (argmax, lowest token id on
    ties); ``top_k`` 0 and
    ``top_p`` 1.0 switch those filters off; ``seed`` keys the counter-based noise.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> "SamplingParams":
        """Raise ValueError naming the bad field and its allowed range."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r}: expected a finite number >= 0 (0 = greedy)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k={k!r}: expected an int >= 0 (0 = off)")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p={p!r}: expected a number in (0, 1] (1 = off)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: expected an int")
        return self

    @property
    def greedy(self) -> bool:
        """Temperatures below :data:`GREEDY_BELOW` decode greedily (``logits / t`` would overflow)."""
        return self.temperature < GREEDY_BELOW


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """One drawn token.  ``sampled_log_prob``: log q(token) under the distribution sampled from."""

    token: int
    sampled_log_prob: float


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_key(request_id: RequestId) -> int:
    """A 64-bit integer for a request id: the id itself for ints, a BLAKE2b digest for strings."""
    if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
        raise TypeError(f"request id must be an int or a str, got {type(request_id).__name__}")
    if isinstance(request_id, int):
        return request_id & _MASK64
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def counter_uniform(seed: int, request_id: RequestId, position: int) -> float:
    """A uniform number in [0, 1) (53 random bits) for ``(seed, request id, position)``.

    Each key component is absorbed through a SplitMix64 finalizer; the same key gives the
    same number in every process, on every device, whatever else is being sampled.
    """
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ request_key(request_id))
    h = _splitmix64(h ^ (int(position) & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sum of the last dim by a Hillis-Steele scan (fixed order, exact adds).

    Step ``d`` (1, 2, 4, ...) adds element ``i - d`` to element ``i``: each output's bits
    depend only on the values of its own row, never on the row's length, the batch or threads.
    """
    n, d = x.shape[-1], 1
    while d < n:
        x = torch.cat([x[..., :d], x[..., d:] + x[..., :-d]], dim=-1)
        d *= 2
    return x


LogSoftmax = Callable[[torch.Tensor], torch.Tensor]


def vocab_log_probs(z: torch.Tensor, leaves: int = DEFAULT_LEAVES) -> torch.Tensor:
    """fp32 ``z - logsumexp(z)`` over the last dim, with tpinv's contract ``logsumexp``.

    The same formula and order as the training cross-entropy (``-(logsumexp - z[target])``),
    so at temperature 1 an entry has the bits of :meth:`tpinv.models.Transformer.log_probs`.
    """
    z = z.to(torch.float32)
    return z - logsumexp(z, leaves).unsqueeze(-1)


def sample_row(logits: torch.Tensor, params: SamplingParams, request_id: RequestId, position: int, *,
               leaves: int = DEFAULT_LEAVES, log_softmax: Optional[LogSoftmax] = None) -> SampleOutput:
    """Draw the token at absolute ``position`` of a request from its full-vocabulary ``logits [V]``.

    Greedy: the argmax (first index of the maximum).  Otherwise: ``z = logits / temperature``,
    ``logp = log_softmax(z)`` (default :func:`vocab_log_probs` with ``leaves`` leaves; the vanilla
    control passes its own); candidates sorted by (logp desc, id asc); top-k keeps the first
    ``top_k``; top-p
    then keeps the shortest prefix of those whose exclusive cumulative probability, renormalized
    over the top-k survivors, is below ``top_p`` (the token that crosses it stays, and the first
    always stays) -- the order HF and vLLM apply the filters in; with ``Z`` the kept mass (scan
    total), the token is the first kept candidate whose cumulative mass exceeds ``u * Z``.
    ``sampled_log_prob = logp[token] - log(Z)``, and exactly ``logp[token]`` when no filter
    removed anything (so at temperature 1 without filters it has the raw log-prob's bits).
    """
    if logits.dim() != 1:
        raise ValueError(f"logits must be one full-vocabulary row of shape [V], got {list(logits.shape)}")
    if params.greedy:
        return SampleOutput(int(torch.argmax(logits)), 0.0)
    z = logits.to(torch.float32)
    if params.temperature != 1:
        z = z / float(params.temperature)
    logp = (log_softmax or (lambda t: vocab_log_probs(t, leaves)))(z[None])[0].to(torch.float32)
    sorted_lp, order = torch.sort(logp, descending=True, stable=True)
    probs = torch.exp(sorted_lp)
    V = probs.shape[0]
    keep = torch.ones(V, dtype=torch.bool, device=probs.device)
    if 0 < params.top_k < V:
        keep[params.top_k:] = False
    if params.top_p < 1.0:  # on the top-k survivors, renormalized: exclusive mass < top_p * their total
        cum = prefix_sum(torch.where(keep, probs, torch.zeros_like(probs)))
        exclusive = torch.cat([cum.new_zeros(1), cum[:-1]])
        keep &= exclusive < cum[-1] * float(params.top_p)
        keep[0] = True
    truncated = not bool(keep.all())
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    cum = prefix_sum(kept)
    total = cum[-1]
    threshold = counter_uniform(params.seed, request_id, position) * float(total)
    last_kept = int(keep.nonzero()[-1])
    j = min(int((cum.double() <= threshold).sum()), last_kept)
    token = int(order[j])
    lp = sorted_lp[j] - torch.log(total) if truncated else sorted_lp[j]
    return SampleOutput(token, float(lp))


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], request_ids: Sequence[RequestId],
                positions: Sequence[int], *, leaves: int = DEFAULT_LEAVES,
                log_softmax: Optional[LogSoftmax] = None) -> list[SampleOutput]:
    """:func:`sample_row` for each row of ``logits [n, V]`` (each row on its own)."""
    if logits.dim() != 2 or not len(params) == len(request_ids) == len(positions) == logits.shape[0]:
        raise ValueError(f"logits must be [n, V] with n = len(params) = len(request_ids) = len(positions); got "
                         f"{list(logits.shape)}, {len(params)}, {len(request_ids)}, {len(positions)}")
    return [sample_row(logits[i], p, r, pos, leaves=leaves, log_softmax=log_softmax)
            for i, (p, r, pos) in enumerate(zip(params, request_ids, positions))]
