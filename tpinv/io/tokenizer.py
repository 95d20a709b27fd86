"""Offline tokenizers behind one small interface: ``encode``, ``decode``, ``bos_id``, ``eos_id``, ``vocab_size``.

``load_tokenizer(path)`` reads a HF ``tokenizer.json`` with the ``tokenizers`` library or a
sentencepiece model with ``sentencepiece``, from a file (recognised by its content) or a model directory.
Nothing is downloaded.  ``encode`` returns the plain token ids of the text (no special
tokens unless ``add_bos`` / ``add_eos`` ask for them), so the same text gives the same ids
whatever the backend's defaults for special tokens are.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

HF_FILE, SENTENCEPIECE_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer.model", "tokenizer_config.json"

#: Special tokens looked up by name when no ``tokenizer_config.json`` names them.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")


class Tokenizer:
    """The interface every backend implements."""

    bos_id: Optional[int]
    eos_id: Optional[int]
    vocab_size: int

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._encode(text)
        if add_bos:
            ids = [self._require(self.bos_id, "bos")] + ids
        if add_eos:
            ids = ids + [self._require(self.eos_id, "eos")]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._decode(ids)

    def _require(self, token_id: Optional[int], what: str) -> int:
        if token_id is None:
            raise ValueError(f"this tokenizer has no {what} token")
        return token_id

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` read by the ``tokenizers`` library."""

    def __init__(self, path: str, config: Optional[dict] = None):
        from tokenizers import Tokenizer as _Tokenizer
        self.path = path
        self._tok = _Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = config or {}
        self.bos_id = self._special(config.get("bos_token"), _BOS_NAMES)
        self.eos_id = self._special(config.get("eos_token"), _EOS_NAMES)

    def _special(self, token, fallbacks: Sequence[str]) -> Optional[int]:
        if isinstance(token, dict):
            token = token.get("content")
        if token is not None:
            token_id = self._tok.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{self.path}: special token {token!r} named by {CONFIG_FILE} is not in the vocabulary")
            return token_id
        for name in fallbacks:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def _encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``tokenizer.model``."""

    def __init__(self, path: str):
        import sentencepiece
        self.path = path
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{path} is not a sentencepiece model ({' '.join(str(e).split())}); expected a "
                             f"{HF_FILE} (tokenizers) or a sentencepiece {SENTENCEPIECE_FILE} file") from None
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def _encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))

    def _decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


def _read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


TEKKEN_FILE = "tekken.json"


def _sniff(path: str) -> str:
    """``"hf"``, ``"tekken"`` or ``"sentencepiece"`` from a file's content (its name does not matter)."""
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    if not head.startswith(b"{"):
        return "sentencepiece"  # a protobuf; its loader says so if it is not one
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: looks like JSON but cannot be parsed ({e}); expected a {HF_FILE}") from None
    if isinstance(obj, dict) and "model" in obj:
        return "hf"
    if isinstance(obj, dict) and "vocab" in obj and "config" in obj:
        return "tekken"
    raise ValueError(f"{path}: a JSON file that is not a HF {HF_FILE} (no 'model' section)")


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer in ``path``: a ``tokenizer.json`` / sentencepiece model file or a directory holding one.

    A file is recognised by its content, so ``tokenizer.model.v1`` loads; Mistral's
    ``tekken.json`` (a tiktoken-style rank table) is refused with a message saying so.  In a
    directory ``tokenizer.json`` is preferred, then ``tokenizer.model`` and ``tokenizer.model.v*``;
    ``tokenizer_config.json`` beside a ``tokenizer.json`` names its bos/eos tokens when present.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        versions = sorted(n for n in os.listdir(path) if n.startswith(SENTENCEPIECE_FILE + ".v"))
        for name in (HF_FILE, SENTENCEPIECE_FILE, *reversed(versions), TEKKEN_FILE):
            if os.path.isfile(os.path.join(path, name)):
                return load_tokenizer(os.path.join(path, name))
        raise FileNotFoundError(f"{path} holds neither {HF_FILE} nor {SENTENCEPIECE_FILE}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such tokenizer file or directory")
    kind = _sniff(path)
    if kind == "hf":
        return HFTokenizer(path, _read_config(os.path.dirname(path)))
    if kind == "tekken":
        raise ValueError(f"{path} is a Mistral tekken tokenizer (a tiktoken-style byte-pair rank table), which "
                         f"is not supported; pass the model's {HF_FILE} or sentencepiece {SENTENCEPIECE_FILE} instead")
    return SentencePieceTokenizer(path)
