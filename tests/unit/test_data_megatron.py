"""Megatron's indexed data in tpinv: tools/preprocess_data.py round trips, the documented blend
mixture, the order a function of (seed, sample index), --data-path / list settings, clear errors.

Each corpus and tokenizer is made in tmp_path (tpinv.testing.corpus: the ``tokenizers`` library)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tpinv.testing import assert_bits_differ, assert_same_bits
from tpinv.testing.corpus import tiny_corpus_jsonl, tiny_tokenizer_json
from tpinv.testing.scripts import load_script

pytest.importorskip("megatron.core")



def _tool():
    return load_script("tools/preprocess_data.py")


def _preprocess(tmp_path, name, *extra, docs=40, upper=False):
    corpus = tiny_corpus_jsonl(str(tmp_path / f"{name}.jsonl"), name, docs=docs, upper=upper)
    tok = str(tmp_path / "tokenizer.json")
    if not os.path.exists(tok):
        tiny_tokenizer_json(str(tmp_path))
    assert _tool().main(["--input", corpus, "--output-prefix", str(tmp_path / "out" / name), "--tokenizer", tok,
                         "--log-interval", "0", *extra]) == 0
    return str(tmp_path / "out" / f"{name}_text_document"), corpus, tok


def _as_tensor(ids) -> torch.Tensor:
    return torch.from_numpy(np.asarray(ids).astype(np.int64))


def test_preprocess_round_trip_equals_the_tokenizer_ids(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tpinv.io.tokenizer import load_tokenizer
    prefix, corpus, tok_path = _preprocess(tmp_path, "a", "--append-eod")
    plain, _, _ = _preprocess(tmp_path, "p")  # another corpus name, no eod: the control below
    tok = load_tokenizer(tok_path)
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    ds = IndexedDataset(prefix)
    assert len(ds) == len(texts) == 40 and ds.index.dtype == np.uint16  # Megatron's dtype for a small vocab
    for d, text in enumerate(texts):
        want = np.asarray(tok.encode(text) + [tok.eos_id], dtype=np.uint16)
        assert ds[d].tobytes() == want.tobytes(), f"document {d}"
    assert_same_bits(_as_tensor(np.concatenate([ds[d] for d in range(len(ds))])),
                     _as_tensor([i for t in texts for i in tok.encode(t) + [tok.eos_id]]), "all documents")
    # control: without --append-eod the documents are the bare ids (each one id shorter)
    no_eod = IndexedDataset(plain)
    p_text = json.loads(open(tmp_path / "p.jsonl", encoding="utf-8").readline())["text"]
    assert_same_bits(_as_tensor(no_eod[0]), _as_tensor(tok.encode(p_text)), "document 0 without --append-eod")
    assert_bits_differ(_as_tensor(no_eod[0]), _as_tensor(tok.encode(p_text) + [tok.eos_id]), "eod control")


def test_preprocess_errors_are_clear_and_leave_no_output(tmp_path, capsys):
    tool = _tool()
    tok = tiny_tokenizer_json(str(tmp_path))
    out = tmp_path / "out" / "c"

    def run(lines, *extra, input_name="c.jsonl"):
        path = tmp_path / input_name
        path.write_text("".join(line + "\n" for line in lines))
        rc = tool.main(["--input", str(path), "--output-prefix", str(out), "--tokenizer", tok, "--log-interval", "0",
                        *extra])
        assert rc == 1 and not any((tmp_path / "out").glob("c_*")), "a failed run left output"
        return capsys.readouterr().err

    good = json.dumps({"text": "tensor parallel"})
    assert "line 2: no key 'text' (keys: 'body')" in run([good, json.dumps({"body": "x"})])
    assert "line 1: no key 'content'" in run([good], "--json-keys", "content")
    assert "line 2: 'text' is an empty document" in run([good, json.dumps({"text": ""})])
    assert "line 1: not a JSON object" in run(["{not json"])
    assert "'text' must be a string, got int" in run([json.dumps({"text": 3})])
    assert "holds no documents" in run([""])
    assert "expected a .jsonl or .txt file" in run([good], input_name="c.csv")
    (tmp_path / "bad.json").write_text("{\"not\": \"a tokenizer\"}")
    err = run([good], "--tokenizer", str(tmp_path / "bad.json"))
    assert "could not be read" in err and "bad.json" in err
    assert "not found" in run([good], "--tokenizer", str(tmp_path / "missing.json"))


def _corpus(data_path, tok, seed=1, num_samples=200, seq_len=8, cache=None):
    from tpinv.training.data import make_dataset
    return make_dataset("arithmetic", seq_len, seed, data_path=data_path, tokenizer=tok, num_samples=num_samples,
                        data_cache_path=cache)


def documented_blend(weights, n):
    """docs/training.md's rule: sample i from the k maximizing w[k] * max(i, 1) - drawn[k] (ties: lowest k)."""
    w = [x / sum(weights) for x in weights]
    drawn, ids = [0] * len(w), []
    for i in range(n):
        err = [w[k] * max(i, 1) - drawn[k] for k in range(len(w))]
        k = err.index(max(err))
        ids.append(k)
        drawn[k] += 1
    return ids


def test_a_blend_of_two_gives_the_documented_mixture(tmp_path):
    a, _, tok = _preprocess(tmp_path, "a")
    b, _, _ = _preprocess(tmp_path, "b", upper=True)
    n = 200
    ds = _corpus(["0.7", a, "0.3", b], tok, num_samples=n)
    ids = ds.dataset_ids(0, n)
    assert ids.tolist() == documented_blend([0.7, 0.3], n)
    assert np.bincount(ids).tolist() == [140, 60]  # docs/training.md: 0.7 * 200 and 0.3 * 200
    for m in range(1, n + 1):  # every prefix within one sample of w * m
        counts = np.bincount(ids[:m], minlength=2)
        assert abs(counts[0] - 0.7 * m) < 1 and abs(counts[1] - 0.3 * m) < 1, m
    # each row comes from the dataset named: b's words are capitals, a's lowercase (tpinv.testing.corpus)
    from tokenizers import Tokenizer
    pieces = Tokenizer.from_file(tok)
    rows = ds.batch(0, n).tokens
    from_b = [any(any(ch.isupper() for ch in pieces.id_to_token(t)) for t in rows[i].tolist()) for i in range(n)]
    assert from_b == [k == 1 for k in ids.tolist()]
    # weights 1 3 (unnormalized) vs 0.25 0.75: the same blend; 3 datasets with a tie
    assert _corpus(["1", a, "3", b], tok, num_samples=40).dataset_ids(0, 40).tolist() == documented_blend([1, 3], 40)
    c, _, _ = _preprocess(tmp_path, "c")
    three = _corpus(["0.5", a, "0.25", b, "0.25", c], tok, num_samples=64).dataset_ids(0, 64)
    assert three.tolist() == documented_blend([0.5, 0.25, 0.25], 64) and np.bincount(three).tolist() == [32, 16, 16]


def test_the_order_is_a_function_of_seed_and_index(tmp_path):
    a, _, tok = _preprocess(tmp_path, "a")
    b, _, _ = _preprocess(tmp_path, "b")
    blend = ["0.6", a, "0.4", b]
    ds = _corpus(blend, tok, seed=5)
    whole = ds.batch(10, 24)
    parts = [ds.batch(10, 8), ds.batch(18, 16)]  # any split of the range: the same rows
    assert_same_bits(torch.cat([p.tokens for p in parts]), whole.tokens, "batch(10, 24) vs two parts")
    assert_same_bits(whole.tokens[:, 1:], whole.targets[:, :-1], "targets are the tokens shifted by one")
    assert bool((whole.loss_mask == 1).all()) and whole.loss_mask.dtype == torch.float32
    again = _corpus(blend, tok, seed=5)  # a resumed run: rebuilt from megatron's index cache
    assert_same_bits(again.batch(10, 24).tokens, whole.tokens, "rebuilt from the cache")
    other = _corpus(blend, tok, seed=6)  # control: the seed shuffles each dataset's documents and samples
    assert_bits_differ(other.batch(10, 24).tokens, whole.tokens, "seed 5 vs seed 6")
    assert other.dataset_ids(0, 100).tolist() == ds.dataset_ids(0, 100).tolist()  # the interleave has no seed
    with pytest.raises(IndexError, match=r"built for 2\d\d samples"):
        ds.batch(len(ds.samples) - 1, 2)


def test_data_path_settings_and_errors(tmp_path):
    from tpinv.training.config import parse_configs
    a, _, tok = _preprocess(tmp_path, "a")
    cfg, _ = parse_configs(["--data-path", "0.7", a, "0.3", "b_text_document", "--data-cache-path", "c"])
    assert cfg.data_path == ["0.7", a, "0.3", "b_text_document"] and cfg.data_cache_path == "c"
    assert parse_configs([])[0].data_path is None
    yml = tmp_path / "run.yaml"
    yml.write_text(f"data_path: [0.7, {a}, 0.3, b]\n")
    assert parse_configs(["--config", str(yml)])[0].data_path == ["0.7", a, "0.3", "b"]
    yml.write_text(f"data-path: {a}\n")  # one prefix as a scalar
    assert parse_configs(["--config", str(yml)])[0].data_path == [a]
    assert parse_configs(["--config", str(yml), "--data-path", "x"])[0].data_path == ["x"]  # flag over file
    yml.write_text("data_path: [[1, 2]]\n")
    with pytest.raises(ValueError, match=r"data_path item \[1, 2\] is a list, expected str"):
        parse_configs(["--config", str(yml)])
    yml.write_text("data_path: []\n")
    with pytest.raises(ValueError, match="empty list"):
        parse_configs(["--config", str(yml)])

    from tpinv.training.data import make_dataset
    with pytest.raises(ValueError, match="give one of them"):
        make_dataset("x.jsonl", 8, 0, data_path=[a], tokenizer=tok, num_samples=8)
    with pytest.raises(ValueError, match="--data-path needs --tokenizer"):
        make_dataset("arithmetic", 8, 0, data_path=[a], num_samples=8)
    with pytest.raises(ValueError, match="expected pairs of a weight and a prefix"):
        _corpus(["0.7", a, "0.3"], tok)
    with pytest.raises(ValueError, match="weight '-1' of .*: expected a positive number"):
        _corpus(["-1", a, "1", a], tok)
    with pytest.raises(ValueError, match="looks like a weight"):
        _corpus([a, "0.5"], tok)
    b, _, _ = _preprocess(tmp_path, "b")
    sizes = _corpus([a, b], tok, num_samples=8)  # no weights: Megatron's blend by size, one pass
    assert len(sizes.samples) == 8 and sizes.weights is None and set(sizes.dataset_ids(0, 8).tolist()) == {0, 1}
    with pytest.raises(ValueError, match=r"one pass over the datasets: \d+ samples, fewer than .* = 100000"):
        _corpus([a, b], tok, num_samples=100000)
    with pytest.raises(FileNotFoundError, match="missing_text_document.bin and .*idx not found"):
        _corpus([str(tmp_path / "missing_text_document")], tok)


def test_text_files_are_preprocessed_once_into_the_cache(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tpinv.training.data import make_dataset
    from tpinv.training.data_megatron import preprocessed_text_prefix
    from tpinv.training.preprocess import ByteTokenizer
    txt = tmp_path / "a.txt"
    txt.write_text("hello world, " * 20)
    ds = make_dataset(str(txt), 8, 0, num_samples=12, data_cache_path=str(tmp_path / "cache"))
    b = ds.batch(0, 12)
    assert b.tokens.shape == (12, 8) and ds.vocab_size == 256 and bool((b.loss_mask == 1).all())
    prefix = preprocessed_text_prefix(str(txt), ByteTokenizer(), None, str(tmp_path / "cache"))
    assert ds.prefixes == [prefix]
    indexed = IndexedDataset(prefix)  # held: its documents are views of its memory map
    assert_same_bits(_as_tensor(indexed[0]), _as_tensor(list(b"hello world, " * 20) + [0]),
                     "the .txt file as one UTF-8 document ending in byte 0")
    stamp = os.stat(prefix + ".bin").st_mtime_ns
    make_dataset(str(txt), 8, 0, num_samples=12, data_cache_path=str(tmp_path / "cache"))
    assert os.stat(prefix + ".bin").st_mtime_ns == stamp  # an unchanged file is not preprocessed again
    txt.write_text("changed text, " * 20)  # a changed one is
    assert preprocessed_text_prefix(str(txt), ByteTokenizer(), None, str(tmp_path / "cache")) != prefix
    jl = tmp_path / "a.jsonl"
    jl.write_text("\n".join(json.dumps({"text": f"document {i}"}) for i in range(10)))
    assert make_dataset(str(jl), 8, 0, num_samples=4).batch(0, 4).tokens.shape == (4, 8)
    assert (tmp_path / "cache").is_dir() and any((tmp_path / "cache").glob("a-*"))  # default: beside the data
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(ValueError, match="line 1: no key 'text'"):
        make_dataset(str(tmp_path / "bad.jsonl"), 8, 0, num_samples=4)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("bad-")]  # nothing half-made
    with pytest.raises(FileNotFoundError, match="not found"):
        make_dataset(str(tmp_path / "missing.txt"), 8, 0, num_samples=4)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        make_dataset(str(txt), 8, 0, tokenizer=str(tmp_path / "nope.json"), num_samples=4)
