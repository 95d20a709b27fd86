"""Dropout whose keep mask is a hash of where an element sits in the whole computation.

Invariant kept: an element's keep bit depends only on a key (the dropout seed and site) and
on integer *words* that name the element independently of how the work is split -- never on
a random-number generator's state, on which rank holds the element or on the shapes of the
local tensors.  The models' hidden dropout names an element by (the row's global sample
index, the token's column in its row, the hidden feature), so its mask is the same at every
TP size, with sequence parallelism (a rank's sequence chunk starts at its global column),
and at every data-parallel size or micro-batch split (rows carry their global sample ids);
the megatron integration (:mod:`tpinv.megatron.dropout`) names elements the same way in
megatron's ``[s, b, h]`` layout (and an attention probability by sample, global head, query
and key position).  Both use :func:`keep_mask`, a counter-based integer hash computed with
exact int64 tensor ops, and :func:`apply_keep`, an elementwise ``x / (1 - p)`` or zero.
Being a pure function, the mask is recomputed bit for bit by activation recomputation.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["dropout_key", "keep_mask", "token_keep_mask", "apply_keep", "check_dropout_rate", "check_sample_ids",
           "TokenDropout", "token_dropout"]

_M = 0xFFFFFFFF
_C = 0x45D9F3B
#: Sample ids are one 32-bit hash word.
MAX_SAMPLE_ID = _M


def _mix_int(h: int) -> int:
    h = ((h ^ (h >> 16)) * _C) & _M
    h = ((h ^ (h >> 16)) * _C) & _M
    return h ^ (h >> 16)


def _mix(h: torch.Tensor) -> torch.Tensor:
    h = ((h ^ (h >> 16)) * _C) & _M
    h = ((h ^ (h >> 16)) * _C) & _M
    return h ^ (h >> 16)


def dropout_key(*words: int) -> int:
    """A 32-bit key hashed from integers (e.g. seed, site, call), first to last."""
    if not words:
        raise ValueError("dropout_key needs at least one word (the seed)")
    key = _mix_int(int(words[0]) & _M)
    for w in words[1:]:
        key = _mix_int(key ^ (int(w) & _M))
    return key


def keep_mask(key: int, words: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    """Boolean keep mask: ``h = key``, then ``h = mix(h ^ w)`` for each int64 word tensor
    (values in ``[0, 2**32)``, broadcast together); an element is kept where
    ``h >= round(p * 2**32)`` (probability ``1 - p``)."""
    if not words:
        raise ValueError("keep_mask needs at least one word tensor naming the elements")
    h = None
    for w in words:
        h = _mix((w ^ key) if h is None else (h ^ w))
    return h >= int(round(p * 2.0 ** 32))


def apply_keep(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """``x / (1 - p)`` where ``keep``, else 0 (elementwise, exact per element)."""
    return torch.where(keep, x / (1.0 - p), torch.zeros((), dtype=x.dtype, device=x.device))


def check_dropout_rate(name: str, p) -> float:
    """``p`` as a float in ``[0, 1)``, else a ValueError naming the setting."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"{name}={p!r}: expected a probability in [0, 1)")
    return float(p)


def check_sample_ids(sample_ids) -> torch.Tensor:
    """``sample_ids`` if it is an int64 tensor ``[B]`` with values in ``[0, 2**32)``, else a ValueError."""
    if not isinstance(sample_ids, torch.Tensor) or sample_ids.dtype != torch.int64 or sample_ids.dim() != 1:
        raise ValueError(f"sample_ids must be an int64 tensor [B] (each row's global sample index), got "
                         f"{getattr(sample_ids, 'dtype', type(sample_ids))} "
                         f"{list(getattr(sample_ids, 'shape', []))}")
    if sample_ids.numel() and (int(sample_ids.min()) < 0 or int(sample_ids.max()) > MAX_SAMPLE_ID):
        raise ValueError(f"sample_ids must lie in [0, 2**32), got [{int(sample_ids.min())}, "
                         f"{int(sample_ids.max())}]")
    return sample_ids


def token_keep_mask(shape, p: float, key: int, sample_ids: torch.Tensor, first_column: int = 0) -> torch.Tensor:
    """Keep mask ``[B, S, H]`` keyed by (``sample_ids[b]``, ``first_column + s``, ``h``)."""
    B, S, H = shape
    dev = sample_ids.device
    words = (sample_ids.to(torch.int64).view(B, 1, 1),
             (torch.arange(S, dtype=torch.int64, device=dev) + first_column).view(1, S, 1),
             torch.arange(H, dtype=torch.int64, device=dev).view(1, 1, H))
    return keep_mask(key, words, p)


def token_dropout(x: torch.Tensor, p: float, key: int, sample_ids: torch.Tensor,
                  first_column: int = 0) -> torch.Tensor:
    """Dropout of ``x [B, S, H]`` keyed by (``sample_ids[b]``, ``first_column + s``, ``h``).

    ``sample_ids`` int64 ``[B]``: each row's global sample index; ``first_column``: the
    column of the first token held here (a rank's sequence chunk under sequence parallelism).
    """
    if p == 0.0:
        return x
    return apply_keep(x, token_keep_mask(x.shape, p, key, sample_ids.to(x.device), first_column), p)


class TokenDropout:
    """The hidden dropout of one training forward: rate, seed, the rows' global sample ids
    and the first token column held by this rank.  ``drop(x, site)`` drops ``x [B, S, H]``
    with the mask of ``site`` (e.g. ``4 * layer + k``)."""

    def __init__(self, p: float, seed: int, sample_ids: torch.Tensor, first_column: int = 0):
        self.p, self.seed, self.first_column = check_dropout_rate("hidden_dropout", p), int(seed), int(first_column)
        self.sample_ids = check_sample_ids(sample_ids)

    def __call__(self, x: torch.Tensor, site: int) -> torch.Tensor:
        if x.dim() != 3 or x.shape[0] != self.sample_ids.shape[0]:
            raise ValueError(f"expected [B, S, H] with B = {self.sample_ids.shape[0]} rows, got {list(x.shape)}")
        return token_dropout(x, self.p, dropout_key(self.seed, site), self.sample_ids, self.first_column)
