"""Offline tokenizers: a sentencepiece model and a tokenizers BPE / WordLevel model built in the test."""
from __future__ import annotations

import io
import json
import os
import re

import pytest

from tpinv.io.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "tensor parallel invariance gives the same bits at any size",
    "a fixed order of additions makes floating point sums reproducible",
    "every rank owns a contiguous run of leaves of the reduction tree",
    "hello world, hello tokenizers and sentencepiece",
] * 20
TEXTS = ["the lazy fox owns the same bits", "hello world", "reproducible sums at any size", ""]


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    import sentencepiece as spm
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=out, vocab_size=120,
                                   model_type="bpe", character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0,
                                   pad_id=-1, minloglevel=2)
    d = tmp_path_factory.mktemp("sp")
    (d / "tokenizer.model").write_bytes(out.getvalue())
    return d


def _bpe_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    _bpe_tokenizer().save(str(d / "tokenizer.json"))
    return d


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_round_trip(sp_dir, text):
    tok = load_tokenizer(str(sp_dir))
    assert isinstance(tok, SentencePieceTokenizer)
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.bos_id == 1 and tok.eos_id == 2 and tok.vocab_size == 120
    assert tok.encode(text, add_bos=True, add_eos=True) == [1] + ids + [2]


def test_sentencepiece_matches_library(sp_dir):
    import sentencepiece as spm
    ref = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tok = load_tokenizer(str(sp_dir / "tokenizer.model"))
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_round_trip(bpe_dir, text):
    tok = load_tokenizer(str(bpe_dir))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.vocab_size == 300
    assert tok.bos_id == 1 and tok.eos_id == 2  # found by name without a tokenizer_config.json


def test_bpe_special_tokens_from_config(tmp_path):
    _bpe_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "</s>"}, "eos_token": "<unk>"}))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id) == (2, 0)
    ids = tok.encode("hello", add_bos=True, add_eos=True)
    assert ids == [2] + tok.encode("hello") + [0]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=re.escape("'<|nope|>' named by tokenizer_config.json")):
        load_tokenizer(str(tmp_path))


def test_word_level_round_trip(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    words = sorted({w for line in CORPUS for w in line.replace(",", "").split()})
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path / "tokenizer.json"))
    ids = t.encode("the quick brown fox")
    assert ids == [vocab[w] for w in "the quick brown fox".split()]
    assert t.decode(ids) == "the quick brown fox"
    assert t.encode("the zebra") == [vocab["the"], 0]
    assert t.bos_id is None and t.eos_id is None
    with pytest.raises(ValueError, match="no bos token"):
        t.encode("the", add_bos=True)


def test_directory_prefers_tokenizer_json(sp_dir, bpe_dir, tmp_path):
    for name, src in (("tokenizer.model", sp_dir), ("tokenizer.json", bpe_dir)):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    assert isinstance(load_tokenizer(str(tmp_path)), HFTokenizer)


def test_bad_inputs(tmp_path, sp_dir):
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such tokenizer"):
        load_tokenizer(str(tmp_path / "missing.model"))
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        load_tokenizer(str(bad))
    other = tmp_path / "vocab.txt"
    other.write_text("x")
    with pytest.raises(ValueError, match="expected a tokenizer.json"):
        load_tokenizer(str(other))
    tok = load_tokenizer(str(sp_dir))
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 120\)"):
        tok.decode([5, 120])


def test_no_network_needed(sp_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("socket.socket.connect", lambda *a, **k: (_ for _ in ()).throw(OSError("no network")))
    assert load_tokenizer(os.fspath(sp_dir)).decode(load_tokenizer(os.fspath(sp_dir)).encode("hello")) == "hello"
