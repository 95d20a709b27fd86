"""Megatron's indexed corpora and blends as a tpinv dataset: sample ``i`` a function of (seed, ``i``) only.

:class:`IndexedCorpus` reads ``.bin``/``.idx`` datasets (``tools/preprocess_data.py``, or
Megatron-LM's) through megatron-core's own classes: each prefix becomes a
:class:`~megatron.core.datasets.gpt_dataset.GPTDataset` (documents shuffled per epoch with the
seed, cut into samples of ``seq_len + 1`` tokens that overlap by one, the samples shuffled), and
a blend of several a :class:`~megatron.core.datasets.blended_dataset.BlendedDataset`, all made
by :class:`~megatron.core.datasets.blended_megatron_dataset_builder.BlendedMegatronDatasetBuilder`
for ``num_samples = steps * global_batch`` samples.  Sample ``i`` depends on the seed, ``i`` and
the dataset's build parameters (prefixes, weights, ``seq_len``, ``num_samples``) -- never on TP,
DP, the rank or a resume: every rank builds the same dataset and the trainer asks it for the
global batch ``[consumed, consumed + global_batch)``.

The blend (megatron-core's ``build_blending_indices``) is greedy: with normalized weights ``w``,
sample ``i`` is drawn from the dataset ``k`` that maximizes ``w[k] * max(i, 1) - drawn[k]``
(``drawn[k]``: samples dataset ``k`` gave to ``0..i-1``; a tie goes to the lowest ``k``), and is
that dataset's next sample.  With two datasets the first ``n`` samples hold within one sample of
``w[k] * n`` from dataset ``k``, at every ``n``; which dataset serves sample ``i`` does not depend
on the seed (the seed chooses the rows each dataset serves).  docs/training.md works an example.

Index caches: megatron writes its document/sample/shuffle indices under ``cache_path``; rank 0
builds them and the other ranks read them after a barrier on the default group (megatron-core's
own protocol), so ``cache_path`` must be one directory every rank sees.  A ``.txt``/``.jsonl``
file given as ``--data`` is preprocessed once into the same cache (:func:`preprocessed_text_prefix`).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["IndexedCorpus", "default_cache_path", "parse_data_path", "preprocessed_text_prefix"]

#: Cache directory under the data's directory when ``--data-cache-path`` is not given.
CACHE_DIR_NAME = "cache"


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """Megatron's ``--data-path``: ``PREFIX...`` or ``W1 PREFIX1 W2 PREFIX2 ...`` -> ``(prefixes, weights)``."""
    items = [str(x) for x in data_path]
    if not items:
        raise ValueError("--data-path is empty: give a dataset prefix, or weights and prefixes "
                         "(--data-path 0.7 a_text_document 0.3 b_text_document)")

    def number(x: str) -> Optional[float]:
        try:
            return float(x)
        except ValueError:
            return None

    if number(items[0]) is None:  # prefixes only
        bad = [x for x in items if number(x) is not None]
        if bad:
            raise ValueError(f"--data-path {' '.join(items)}: {bad[0]} looks like a weight; give weights before "
                             f"every prefix (W1 PREFIX1 W2 PREFIX2 ...) or none")
        return items, None
    if len(items) % 2:
        raise ValueError(f"--data-path {' '.join(items)}: expected pairs of a weight and a prefix")
    weights, prefixes = [number(w) for w in items[0::2]], items[1::2]
    for w, raw, p in zip(weights, items[0::2], prefixes):
        if w is None or not (w > 0 and w != float("inf")):
            raise ValueError(f"--data-path: weight {raw!r} of {p}: expected a positive number")
        if number(p) is not None:
            raise ValueError(f"--data-path: {p!r} after weight {raw} is a number, expected a dataset prefix")
    return prefixes, weights


def default_cache_path(first_path: str) -> str:
    """``<directory of the first dataset>/cache`` (beside the data, as Megatron-LM's default)."""
    return os.path.join(os.path.dirname(os.path.abspath(first_path)), CACHE_DIR_NAME)


def _check_prefix(prefix: str) -> None:
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        raise FileNotFoundError(f"--data-path {prefix}: {' and '.join(missing)} not found; a prefix names the "
                                f"pair PREFIX.bin/PREFIX.idx written by tools/preprocess_data.py (e.g. "
                                f"out/corpus_text_document)")


class _TokenizerInfo:
    """What megatron's GPTDataset reads of a tokenizer: the vocabulary size and the end-of-document id."""

    def __init__(self, vocab_size: int, eod: Optional[int]):
        self.vocab_size, self.eod = vocab_size, -1 if eod is None else eod

    @property
    def unique_identifiers(self) -> dict:  # megatron describes config fields through this
        return {"class": "tpinv", "vocab_size": self.vocab_size, "eod": self.eod}


@contextlib.contextmanager
def _default_group():
    """megatron's builders query the default group's rank; a single process gets a one-rank group."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _import_megatron_datasets():
    try:
        from megatron.core.datasets import helpers  # noqa: F401 - the compiled helpers_cpp
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    except ImportError as exc:
        if "helpers_cpp" in str(exc):  # a source install of megatron-core without its compiled helpers
            raise ImportError(f"megatron-core's compiled dataset helpers are missing ({exc}); build them once "
                              f"with: python -c 'from megatron.core.datasets.utils import compile_helpers; "
                              f"compile_helpers()' (needs a C++ compiler and pybind11)") from exc
        raise ImportError(f"--data-path and --data FILE read Megatron's indexed format through megatron-core "
                          f"({exc}); install it with: pip install 'tpinv[megatron]'") from exc
    return BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig


class IndexedCorpus:
    """Megatron ``--data-path`` datasets (one prefix or a weighted blend) as tpinv's dataset protocol."""

    def __init__(self, data_path: Sequence[str], seq_len: int, seed: int, num_samples: int, *, vocab_size: int,
                 eod: Optional[int], cache_path: Optional[str] = None, tokenizer_path: Optional[str] = None):
        self.prefixes, self.weights = parse_data_path(data_path)
        self.prefixes = [os.path.abspath(p) for p in self.prefixes]
        for p in self.prefixes:
            _check_prefix(p)
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples}: expected the run's steps * global_batch >= 1")
        self.seq_len, self.seed, self.num_samples, self.vocab_size = seq_len, seed, num_samples, vocab_size
        self.tokenizer_path = tokenizer_path
        self.cache_path = os.path.abspath(cache_path or default_cache_path(self.prefixes[0]))
        Builder, GPTDataset, GPTDatasetConfig = _import_megatron_datasets()
        self._check_ids()
        config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_len, blend=(self.prefixes, self.weights), split="1,0,0",
            path_to_cache=self.cache_path, tokenizer=_TokenizerInfo(vocab_size, eod), reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
        with _default_group():
            train, _, _ = Builder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()
        self.samples = train
        if len(train) < num_samples:
            if len(self.prefixes) > 1 and self.weights is None:  # megatron: one pass, in proportion to sizes
                raise ValueError(f"--data-path without weights blends one pass over the datasets: {len(train)} "
                                 f"samples, fewer than the run's steps * global_batch = {num_samples}; give "
                                 f"weights (W1 PREFIX1 W2 PREFIX2 ...) to repeat them")
            raise RuntimeError(f"megatron built {len(train)} samples, fewer than the {num_samples} requested")

    def _check_ids(self) -> None:
        for p in self.prefixes:  # the .idx records the id dtype: uint16 holds ids below 65536 only
            from megatron.core.datasets.indexed_dataset import IndexedDataset
            dtype = IndexedDataset(p).index.dtype
            if np.iinfo(dtype).max < self.vocab_size - 1:
                raise ValueError(f"{p}.bin stores {np.dtype(dtype).name} ids, too narrow for the tokenizer's "
                                 f"{self.vocab_size} ids: it was preprocessed with another tokenizer")

    def describe(self) -> dict:
        return {"kind": "megatron", "data_path": self.prefixes, "weights": self.weights, "seq_len": self.seq_len,
                "seed": self.seed, "num_samples": self.num_samples, "tokenizer": self.tokenizer_path}

    def _check_range(self, start: int, count: int) -> None:
        if start < 0 or count < 0 or start + count > len(self.samples):
            raise IndexError(f"samples [{start}, {start + count}) requested; the data was built for "
                             f"{len(self.samples)} samples (steps * global_batch = {self.num_samples})")

    def batch(self, start: int, count: int):
        """Global samples ``[start, start + count)``: megatron's tokens/labels/loss_mask as a :class:`Batch`."""
        from tpinv.training.data import Batch
        self._check_range(start, count)
        items = [self.samples[i] for i in range(start, start + count)]
        return Batch(torch.stack([it["tokens"] for it in items]).to(torch.int64),
                     torch.stack([it["labels"] for it in items]).to(torch.int64),
                     torch.stack([it["loss_mask"] for it in items]).to(torch.float32))

    def dataset_ids(self, start: int, count: int) -> np.ndarray:
        """Which dataset of the blend (its position in ``--data-path``) serves each sample."""
        self._check_range(start, count)
        index = getattr(self.samples, "dataset_index", None)
        if index is None:
            return np.zeros(count, dtype=np.int64)
        return np.asarray(index[start:start + count], dtype=np.int64)

    def heldout(self) -> None:
        return None


def _fingerprint(paths: Sequence[Optional[str]]) -> str:
    h = hashlib.sha256()
    for path in paths:
        files = [] if path is None else [path] if os.path.isfile(path) else sorted(
            os.path.join(path, n) for n in os.listdir(path) if n.startswith("tokenizer"))
        h.update(f"{len(files)}|".encode())
        for f in files:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            h.update(b"|")
    return h.hexdigest()[:16]


def preprocessed_text_prefix(path: str, tokenizer, tokenizer_path: Optional[str], cache_path: Optional[str]) -> str:
    """The ``--data`` file preprocessed once (rank 0, atomically) into ``cache_path``; its dataset prefix.

    The directory is named by the sha256 of the file's and the tokenizer's bytes, so a changed
    file or tokenizer is preprocessed again and an unchanged one never is.
    """
    from tpinv.training.preprocess import output_prefix_for, preprocess_corpus
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path} not found; expected a .txt file, a .jsonl file with a 'text' "
                                f"field per line, or --data arithmetic")
    cache = os.path.abspath(cache_path or default_cache_path(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    target = os.path.join(cache, f"{stem}-{_fingerprint([path, tokenizer_path])}")
    prefix = output_prefix_for(os.path.join(target, stem), "text")
    rank = dist.get_rank() if dist.is_initialized() else 0
    error = None
    if rank == 0 and not os.path.isdir(target):
        tmp = f"{target}.tmp-{os.getpid()}"
        try:
            preprocess_corpus(path, os.path.join(tmp, stem), tokenizer, append_eod=tokenizer.eos_id is not None,
                              log_interval=0)
            os.replace(tmp, target)
        except BaseException as exc:  # the other ranks must not wait at the barrier for ever
            shutil.rmtree(tmp, ignore_errors=True)
            error = exc
    if dist.is_initialized():
        failed = [error is not None]
        dist.broadcast_object_list(failed, src=0)
        if failed[0] and error is None:
            raise RuntimeError(f"rank 0 could not preprocess {path} (its error names the cause)")
    if error is not None:
        raise error
    return prefix
