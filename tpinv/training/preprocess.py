"""Text corpora into Megatron's indexed format (``.bin``/``.idx``), written by megatron-core's own builder.

:func:`preprocess_corpus` reads a ``.jsonl`` file (one JSON object per line) or a ``.txt`` file
(one document), tokenizes each document with a :func:`tpinv.io.tokenizer.load_tokenizer`
tokenizer and writes, per JSON key, the files ``{output_prefix}_{key}_document.bin/.idx`` with
:class:`megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder` -- the names and layout
Megatron-LM's ``tools/preprocess_data.py`` gives, so the prefix ``{output_prefix}_text_document``
is what ``--data-path`` takes here and in Megatron-LM.  The invariant: document ``d`` of the
written dataset holds exactly ``tokenizer.encode(text_d)`` (plus the end-of-document id with
``append_eod``), in input order; nothing else is added, dropped or reordered.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Iterator, Optional, Sequence, TextIO

__all__ = ["ByteTokenizer", "CorpusError", "load_corpus_tokenizer", "output_prefix_for", "preprocess_corpus"]


class CorpusError(ValueError):
    """A corpus that cannot be preprocessed (bad line, missing key, empty document)."""


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256); byte 0 ends a document."""

    vocab_size, eos_id, bos_id = 256, 0, None

    def encode(self, text: str, **_) -> list[int]:
        return list(text.encode("utf-8"))


def load_corpus_tokenizer(path: Optional[str]):
    """``tokenizer.json`` / ``tokenizer.model`` / a directory holding one; ``None``: UTF-8 bytes."""
    if path is None:
        return ByteTokenizer()
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer {path} not found; expected a tokenizer.json, a tokenizer.model "
                                f"or a directory holding one")
    from tpinv.io.tokenizer import load_tokenizer
    try:
        return load_tokenizer(path)
    except (OSError, RuntimeError, ValueError) as exc:  # the backends' own messages, prefixed with the path
        raise ValueError(f"tokenizer {path} could not be read ({type(exc).__name__}: {exc}); expected a HF "
                         f"tokenizer.json or a sentencepiece tokenizer.model") from exc


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's name of the dataset of one JSON key: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def _documents(path: str, json_keys: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """``(line number, {key: text})`` per document of a ``.jsonl`` or ``.txt`` file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus {path} not found; expected a .jsonl file (one JSON object per line) "
                                f"or a .txt file")
    if path.endswith(".txt"):
        if list(json_keys) != ["text"]:
            raise CorpusError(f"{path}: a .txt file is one document under the key 'text'; --json-keys "
                              f"{' '.join(json_keys)} needs a .jsonl file")
        with open(path, encoding="utf-8") as f:
            yield 1, {"text": f.read()}
        return
    if not path.endswith(".jsonl"):
        raise CorpusError(f"corpus {path}: expected a .jsonl or .txt file")
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path} line {n}: not a JSON object ({e})") from None
            if not isinstance(obj, dict):
                raise CorpusError(f"{path} line {n}: expected a JSON object, got {type(obj).__name__}")
            doc = {}
            for key in json_keys:
                if key not in obj:
                    raise CorpusError(f"{path} line {n}: no key {key!r} (keys: {', '.join(map(repr, obj)) or 'none'});"
                                      f" choose the field with --json-keys")
                if not isinstance(obj[key], str):
                    raise CorpusError(f"{path} line {n}: {key!r} must be a string, got {type(obj[key]).__name__}")
                doc[key] = obj[key]
            yield n, doc


def _optimal_dtype(vocab_size: int):
    from megatron.core.datasets.indexed_dataset import DType
    return DType.optimal_dtype(vocab_size)


def preprocess_corpus(input_path: str, output_prefix: str, tokenizer, *, json_keys: Sequence[str] = ("text",),
                      append_eod: bool = False, log_interval: int = 10000, stream: Optional[TextIO] = None,
                      log: Optional[Callable[[str], None]] = None) -> dict[str, str]:
    """Write ``{output_prefix}_{key}_document.bin/.idx`` per key; returns ``{key: dataset prefix}``.

    ``tokenizer`` has ``encode(text)``, ``vocab_size`` and ``eos_id`` (the end-of-document id
    appended with ``append_eod``).  Progress goes to ``stream`` (default stderr) every
    ``log_interval`` documents and at the end (``log_interval=0``: silent).
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
    if not json_keys:
        raise ValueError("json_keys is empty: name at least one field of the JSON objects")
    if append_eod and tokenizer.eos_id is None:
        raise ValueError("--append-eod needs an end-of-document token, and this tokenizer has no eos token")
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    write = log or (lambda line: print(line, file=stream or sys.stderr, flush=True))
    dtype = _optimal_dtype(tokenizer.vocab_size)
    prefixes = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    builders = {key: IndexedDatasetBuilder(get_bin_path(p), dtype=dtype) for key, p in prefixes.items()}
    start, docs, tokens, n_bytes = time.perf_counter(), 0, 0, 0
    try:
        for line, doc in _documents(input_path, json_keys):
            for key, text in doc.items():
                ids = tokenizer.encode(text)
                if not ids:
                    raise CorpusError(f"{input_path} line {line}: {key!r} is an empty document (no tokens); "
                                      f"remove it from the corpus")
                if append_eod:
                    ids = ids + [tokenizer.eos_id]
                builders[key].add_document(ids, [len(ids)])
                tokens += len(ids)
                n_bytes += len(text.encode("utf-8"))
            docs += 1
            if log_interval and docs % log_interval == 0:
                dt = time.perf_counter() - start
                write(f"processed {docs} documents, {tokens} tokens ({n_bytes / 2**20 / max(dt, 1e-9):.2f} MB/s)")
        if docs == 0:
            raise CorpusError(f"{input_path} holds no documents")
        for key, p in prefixes.items():
            builders[key].finalize(get_idx_path(p))
    except BaseException:
        for b in builders.values():
            b.data_file.close()
        for p in prefixes.values():  # no half-written dataset is left behind
            for f in (get_bin_path(p), get_idx_path(p)):
                if os.path.exists(f):
                    os.remove(f)
        raise
    if log_interval:
        write(f"done: {docs} documents, {tokens} tokens -> {', '.join(p + '.{bin,idx}' for p in prefixes.values())}")
    return prefixes
