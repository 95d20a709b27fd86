"""Tiny corpora and tokenizers for data tests, made offline in a directory (nothing downloaded).

:func:`tiny_tokenizer_json` trains a small BPE ``tokenizer.json`` with the ``tokenizers``
library (``<|endoftext|>`` is its end-of-document token, id 0; at most 120 ids, under the tiny models' 256); :func:`tiny_corpus_jsonl` writes
numbered documents of words, distinct per ``name`` so two corpora are told apart by content.
"""
from __future__ import annotations

import json
import os
import random

__all__ = ["EOD", "tiny_corpus_jsonl", "tiny_tokenizer_json"]

EOD, UNK = "<|endoftext|>", "[UNK]"

_WORDS = ("tensor", "parallel", "same", "bits", "every", "layout", "data", "order", "seed", "sample", "index",
          "blend", "weight", "rank", "loss", "step", "token", "model")


def tiny_corpus_jsonl(path: str, name: str = "a", docs: int = 40, seed: int = 0, key: str = "text",
                      upper: bool = False) -> str:
    """``docs`` JSON lines ``{key: "<name> doc <i>: words..."}`` of 4..20 words; returns ``path``.

    ``upper=True`` writes the words in capitals: no token of such a corpus's words is a token of
    a lowercase one, so a sample of 8+ tokens tells which corpus it came from.
    """
    rng = random.Random(f"{name}:{seed}")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(docs):
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 20)))
            words = words.upper() if upper else words
            f.write(json.dumps({key: f"{name} doc {i}: {words}"}) + "\n")
    return path


def tiny_tokenizer_json(directory: str, vocab_size: int = 120, texts=None) -> str:
    """A BPE ``directory/tokenizer.json`` (whitespace pre-tokenized) of at most ``vocab_size`` ids; returns its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD, UNK], show_progress=False)
    corpus = list(texts) if texts is not None else \
        [" ".join(_WORDS), " ".join(_WORDS).upper()] * 4 + [f"doc {i}:" for i in range(50)]
    tok.train_from_iterator(corpus, trainer)
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    return path
