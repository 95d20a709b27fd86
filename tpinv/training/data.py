"""Training data whose order is a function of (seed, sample index) only -- never of TP or DP size.

Every dataset here maps a global sample index ``i`` to one fixed row of ``seq_len + 1`` token
ids.  The global batch of a step is the samples ``[consumed, consumed + global_batch)``;
:func:`dp_slice` gives data-parallel rank ``d`` the contiguous ``1/D`` block of it, and
:func:`micro_batches` cuts that block into micro-batches in order.  So the rows a model sees
at a step, and their order, are the same at every TP size, and the only training state a
dataset needs is the number of samples consumed.

* :class:`ArithmeticTask`: ``"23+58=81\\n"`` at the byte level (vocab 256, right-padded with
  byte 0), the loss on the answer tokens only (the digits after ``=`` and the newline); a
  fixed held-out set of problems, never drawn for training, measures exact-match accuracy of
  the greedy (argmax) answer tokens, teacher-forced (:meth:`tpinv.training.Trainer.evaluate`).
* :class:`~tpinv.training.data_megatron.IndexedCorpus`: Megatron's indexed ``.bin``/``.idx``
  datasets (``--data-path``, one prefix or a weighted blend) read by megatron-core's GPTDataset
  and BlendedDataset; a ``.txt``/``.jsonl`` ``--data`` file is preprocessed into that format
  once (:mod:`tpinv.training.preprocess`) and read the same way; the loss on every token.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Optional, Sequence

import torch

__all__ = ["Batch", "ArithmeticTask", "make_dataset", "dp_slice", "micro_batches", "PAD_ID"]

#: Padding byte of the arithmetic rows (never a loss target).
PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class Batch:
    """``tokens``/``targets`` int64 ``[B, S]`` and the fp32 ``loss_mask`` (1.0 where the loss counts)."""

    tokens: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor

    @classmethod
    def from_rows(cls, rows: torch.Tensor, mask: torch.Tensor) -> "Batch":
        """Rows ``[B, S+1]`` and a per-target mask ``[B, S]``: inputs ``rows[:, :-1]``, targets ``rows[:, 1:]``."""
        return cls(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), mask.to(torch.float32))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device) -> "Batch":
        return Batch(self.tokens.to(device), self.targets.to(device), self.loss_mask.to(device))

    def rows(self, start: int, stop: int) -> "Batch":
        return Batch(self.tokens[start:stop], self.targets[start:stop], self.loss_mask[start:stop])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.count_nonzero())


def dp_slice(batch: Batch, dp_rank: int, dp_size: int) -> Batch:
    """Data-parallel rank ``dp_rank``'s contiguous block of a global batch."""
    if len(batch) % dp_size:
        raise ValueError(f"global batch of {len(batch)} rows does not split over dp_size={dp_size}; "
                         f"expected a multiple of {dp_size}")
    n = len(batch) // dp_size
    return batch.rows(dp_rank * n, (dp_rank + 1) * n)


def micro_batches(batch: Batch, micro_batch: int) -> list[Batch]:
    """Consecutive micro-batches of ``micro_batch`` rows, in order."""
    if micro_batch < 1 or len(batch) % micro_batch:
        raise ValueError(f"{len(batch)} rows do not split into micro-batches of {micro_batch}; "
                         f"expected a positive divisor of {len(batch)}")
    return [batch.rows(i, i + micro_batch) for i in range(0, len(batch), micro_batch)]


class ArithmeticTask:
    """Addition of two ``digits``-digit numbers as bytes, e.g. ``"23+58=81\\n"``; loss on the answer."""

    vocab_size = 256

    def __init__(self, seq_len: int, seed: int, *, digits: int = 2, heldout_size: Optional[int] = None):
        if not 1 <= digits <= 9:
            raise ValueError(f"digits={digits}: expected 1..9")
        need = 3 * digits + 4  # "a+b=" + up to digits+1 answer digits + "\n" -> seq_len + 1 ids
        if seq_len + 1 < need:
            raise ValueError(f"seq_len={seq_len} is too short for {digits}-digit addition: expected "
                             f"seq_len >= {need - 1}")
        self.seq_len, self.seed, self.digits = seq_len, seed, digits
        self.limit = 10 ** digits
        if heldout_size is None:  # a fifth of the problems, at most 256
            heldout_size = min(256, self.limit ** 2 // 5)
        if not 0 < heldout_size <= self.limit ** 2 // 4:
            raise ValueError(f"heldout_size={heldout_size}: expected 1..{self.limit ** 2 // 4}")
        rng = random.Random(f"tpinv-arithmetic-heldout:{seed}:{digits}")
        self.heldout_pairs = rng.sample(range(self.limit ** 2), heldout_size)
        self._heldout_set = frozenset(self.heldout_pairs)

    def describe(self) -> dict:
        return {"kind": "arithmetic", "seq_len": self.seq_len, "seed": self.seed, "digits": self.digits,
                "heldout_size": len(self.heldout_pairs)}

    def pair(self, index: int) -> tuple[int, int]:
        """The training problem of global sample ``index`` (never one of the held-out problems)."""
        rng = random.Random(f"tpinv-arithmetic:{self.seed}:{index}")
        while True:
            code = rng.randrange(self.limit ** 2)
            if code not in self._heldout_set:
                return divmod(code, self.limit)

    def encode(self, a: int, b: int) -> tuple[list[int], int]:
        """The row's ids (``seq_len + 1``) and the index of the first answer id."""
        prompt, answer = f"{a}+{b}=", f"{a + b}\n"
        ids = list((prompt + answer).encode("ascii"))
        return ids + [PAD_ID] * (self.seq_len + 1 - len(ids)), len(prompt)

    def _rows(self, pairs) -> Batch:
        rows, mask = [], torch.zeros(len(pairs), self.seq_len)
        for r, (a, b) in enumerate(pairs):
            ids, start = self.encode(a, b)
            rows.append(ids)
            stop = start + len(str(a + b)) + 1
            mask[r, start - 1:stop - 1] = 1.0  # target j is row id j + 1
        return Batch.from_rows(torch.tensor(rows, dtype=torch.int64), mask)

    def batch(self, start: int, count: int) -> Batch:
        """Global samples ``[start, start + count)``."""
        return self._rows([self.pair(i) for i in range(start, start + count)])

    def heldout(self) -> Batch:
        return self._rows([divmod(code, self.limit) for code in self.heldout_pairs])


def make_dataset(data: str, seq_len: int, seed: int, *, tokenizer: Optional[str] = None, digits: int = 2,
                 heldout_size: Optional[int] = None, data_path: Optional[Sequence[str]] = None,
                 data_cache_path: Optional[str] = None, num_samples: Optional[int] = None):
    """The run's dataset: ``"arithmetic"``, Megatron ``data_path`` prefixes (a blend), or a text file.

    ``data_path`` and a ``.txt``/``.jsonl`` file both give an
    :class:`~tpinv.training.data_megatron.IndexedCorpus` of ``num_samples`` samples (the file is
    first preprocessed into ``data_cache_path``, tokenized with ``tokenizer``, else as UTF-8 bytes).
    """
    if data_path:
        if data != "arithmetic":
            raise ValueError(f"--data {data} and --data-path {' '.join(map(str, data_path))}: give one of them")
        if tokenizer is None:
            raise ValueError("--data-path needs --tokenizer: the tokenizer.json / tokenizer.model the corpus was "
                             "preprocessed with (its vocabulary is checked against the model's)")
    elif data == "arithmetic":
        return ArithmeticTask(seq_len, seed, digits=digits, heldout_size=heldout_size)
    from tpinv.training.data_megatron import IndexedCorpus, preprocessed_text_prefix
    from tpinv.training.preprocess import load_corpus_tokenizer
    if num_samples is None:
        raise ValueError("num_samples is needed for a corpus: the run's steps * global_batch")
    tok = load_corpus_tokenizer(tokenizer)
    if not data_path:
        data_path = [preprocessed_text_prefix(data, tok, tokenizer, data_cache_path)]
    return IndexedCorpus(data_path, seq_len, seed, num_samples, vocab_size=tok.vocab_size, eod=tok.eos_id,
                         cache_path=data_cache_path, tokenizer_path=tokenizer)
