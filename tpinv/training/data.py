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
* :class:`TextDataset`: a ``.txt`` file or a ``.jsonl`` file with a ``"text"`` field, tokenized
  with :func:`tpinv.io.tokenizer.load_tokenizer` (or as UTF-8 bytes), cut into windows of
  ``seq_len + 1`` tokens, visited in a seeded permutation per epoch; the loss on every token.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Optional

import numpy as np
import torch

__all__ = ["Batch", "ArithmeticTask", "TextDataset", "ByteTokenizer", "make_dataset", "dp_slice",
           "micro_batches", "PAD_ID"]

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


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256); byte 0 separates documents."""

    vocab_size, eos_id, bos_id = 256, 0, None

    def encode(self, text: str, **_) -> list[int]:
        return list(text.encode("utf-8"))


def _read_documents(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path} not found; expected a .txt file, a .jsonl file "
                                f"with a 'text' field per line, or --data arithmetic")
    if path.endswith(".jsonl"):
        docs = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path} line {n}: expected a JSON object with a 'text' string "
                                     f"({type(e).__name__}: {e})") from None
                if not isinstance(text, str):
                    raise ValueError(f"{path} line {n}: 'text' must be a string, got {type(text).__name__}")
                docs.append(text)
        return docs
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            return [f.read()]
    raise ValueError(f"data file {path}: expected a .txt or .jsonl file")


class TextDataset:
    """Windows of ``seq_len + 1`` tokens of a text or jsonl file, a seeded permutation per epoch."""

    def __init__(self, path: str, seq_len: int, seed: int, tokenizer=None, tokenizer_path: Optional[str] = None):
        self.path, self.seq_len, self.seed = os.path.abspath(path), seq_len, seed
        self.tokenizer_path = tokenizer_path
        tok = tokenizer if tokenizer is not None else ByteTokenizer()
        self.vocab_size = tok.vocab_size
        ids: list[int] = []
        for doc in _read_documents(path):
            ids += tok.encode(doc)
            if tok.eos_id is not None:
                ids.append(tok.eos_id)
        self.num_tokens = len(ids)
        self.num_windows = (len(ids) - 1) // seq_len if ids else 0
        if self.num_windows < 1:
            raise ValueError(f"{path} has {len(ids)} tokens; expected at least seq_len + 1 = {seq_len + 1}")
        self.ids = torch.tensor(ids[:self.num_windows * seq_len + 1], dtype=torch.int64)
        self._perm: dict[int, np.ndarray] = {}

    def describe(self) -> dict:
        return {"kind": "text", "path": self.path, "tokenizer": self.tokenizer_path, "seq_len": self.seq_len,
                "seed": self.seed, "num_tokens": self.num_tokens}

    def _window(self, index: int) -> int:
        epoch, k = divmod(index, self.num_windows)
        if epoch not in self._perm:
            self._perm = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)}
        return int(self._perm[epoch][k])

    def batch(self, start: int, count: int) -> Batch:
        rows = torch.stack([self.ids[w * self.seq_len:(w + 1) * self.seq_len + 1]
                            for w in (self._window(i) for i in range(start, start + count))])
        return Batch.from_rows(rows, torch.ones(count, self.seq_len))

    def heldout(self) -> None:
        return None


def make_dataset(data: str, seq_len: int, seed: int, *, tokenizer: Optional[str] = None, digits: int = 2,
                 heldout_size: Optional[int] = None):
    """``"arithmetic"`` or a path to a ``.txt`` / ``.jsonl`` file (tokenized with ``tokenizer``, else bytes)."""
    if data == "arithmetic":
        return ArithmeticTask(seq_len, seed, digits=digits, heldout_size=heldout_size)
    tok = None
    if tokenizer is not None:
        if not os.path.exists(tokenizer):
            raise FileNotFoundError(f"tokenizer {tokenizer} not found; expected a tokenizer.json, a "
                                    f"tokenizer.model or a directory holding one")
        from tpinv.io.tokenizer import load_tokenizer
        tok = load_tokenizer(tokenizer)
    return TextDataset(data, seq_len, seed, tok, tokenizer)
