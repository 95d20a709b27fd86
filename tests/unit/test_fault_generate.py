"""Bad input to ``launch/generate.py``: one bad line gives one error result and the others run;
bad paths fail before any model work with one ``error:`` line; the output is standard JSON;
tokenizer files are recognised by content (``tokenizer.model.v1``) and ``tekken.json`` is
refused saying what it is."""
from __future__ import annotations

import io
import json
import os

import pytest

from tpinv.io.tokenizer import SentencePieceTokenizer, load_tokenizer
from tpinv.testing import num_threads
from tpinv.testing.scripts import load_script



def _generate():
    return load_script("launch/generate.py")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with num_threads(1):
        yield


LINES = [
    {"id": "ok", "prompt_ids": [1, 2, 3], "max_tokens": 2, "temperature": 0},
    {"id": "stop5", "prompt_ids": [1, 2], "stop": 5},
    {"id": "ids5", "prompt_ids": [1, 2], "stop_token_ids": 5},
    {"id": "eos", "prompt_ids": [1, 2], "ignore_eos": "false"},
    {"id": "temp", "prompt_ids": [1, 2], "temperature": "0.5"},
    {"id": "ids", "prompt_ids": [1, "2"]},
    {"id": "ok2", "prompt_ids": [4, 5], "max_tokens": 3, "temperature": 0},
]
BAD = {"stop5": "field 'stop' is 5; expected a string or a list of strings",
       "ids5": "field 'stop_token_ids' is 5; expected a list of ints",
       "eos": "field 'ignore_eos' is \"false\"; expected true or false",
       "temp": "field 'temperature' is \"0.5\"; expected a number",
       "ids": "field 'prompt_ids' is [1, \"2\"]; expected a list of ints"}


def test_each_bad_field_fails_its_own_line_only(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    out = tmp_path / "out.jsonl"
    gen = _generate()
    assert gen.main(["--model", "qwen3-tiny", "--input", str(src), "--output", str(out)]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == len(LINES)
    for line, res in zip(LINES, results):
        if line["id"] in BAD:
            assert res["finish_reason"] == "error" and BAD[line["id"]] in res["error"], res
        else:
            assert res["id"] == line["id"] and res["error"] is None and len(res["token_ids"]) == line["max_tokens"]


def test_a_stop_string_is_one_stop():
    from tpinv.engine.scheduler import request_from_json
    assert request_from_json({"prompt": "a", "stop": "xyz"}, 0).stop == ("xyz",)
    assert request_from_json({"prompt": "a", "stop": ["x", "yz"]}, 0).stop == ("x", "yz")


@pytest.mark.parametrize("case", ["no_output_dir", "output_is_dir", "no_input", "binary_input"])
def test_bad_paths_fail_before_the_model_is_built(case, tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(LINES[0]) + "\n")
    out = tmp_path / "out.jsonl"
    if case == "no_output_dir":
        out, want = tmp_path / "missing" / "out.jsonl", "the directory .*missing does not exist"
    elif case == "output_is_dir":
        out, want = tmp_path, "is a directory; expected a file name"
    elif case == "no_input":
        src, want = tmp_path / "nope.jsonl", "--input .*nope.jsonl: no such file"
    else:
        src.write_bytes(b"\x00\xff\xfe binary")
        want = "is not UTF-8 text"
    from tpinv.engine import Engine
    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("the model was loaded")))
    assert _generate().main(["--model", "qwen3-tiny", "--input", str(src), "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    import re
    assert re.search(want, err[0]), err[0]


def test_results_with_non_finite_values_become_standard_json_errors():
    import torch
    from tpinv.engine.scheduler import Result, error_result
    res = Result("r", [1], [2], torch.tensor([float("nan")]), torch.tensor([0.0]), "length")
    line, error = _generate().result_line(res, 3, error_result)
    parsed = json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in the output"))
    assert parsed["error"] == error and error.startswith("line 3: the result holds a non-finite")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["hello world the same bits"] * 50), model_writer=out,
                                   vocab_size=30, model_type="bpe", character_coverage=1.0, minloglevel=2)
    return out.getvalue()


def test_tokenizer_files_are_recognised_by_content(tmp_path, sp_model):
    (tmp_path / "tokenizer.model.v1").write_bytes(sp_model)
    assert isinstance(load_tokenizer(str(tmp_path / "tokenizer.model.v1")), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path)), SentencePieceTokenizer)  # found in a directory too


def test_tekken_json_is_refused_saying_what_it_is(tmp_path):
    tekken = {"config": {"pattern": "x", "num_vocab_tokens": 3, "default_vocab_size": 3},
              "vocab": [{"rank": 0, "token_bytes": "YQ==", "token_str": "a"}], "special_tokens": []}
    (tmp_path / "tekken.json").write_text(json.dumps(tekken))
    for path in (tmp_path / "tekken.json", tmp_path):
        with pytest.raises(ValueError, match="is a Mistral tekken tokenizer .* not supported; pass the model's "
                                             "tokenizer.json"):
            load_tokenizer(str(path))


def test_non_finite_logits_end_only_that_request_with_an_error():
    import torch
    from tpinv.engine import Engine, Request, SamplingParams
    from tpinv.io.loading import load_model
    model, _ = load_model("qwen3-tiny")
    reqs = [Request(i, [1 + i, 2, 3], max_tokens=3, sampling=SamplingParams(0.0)) for i in range(3)]
    clean = Engine(model, max_batch=3).generate(reqs)
    engine = Engine(model, max_batch=3)
    real = engine._draw

    def draw(state, row):  # request 1's logits turn NaN at its second token
        if state.request.request_id == 1 and len(state.tokens) == 1:
            row = torch.full_like(row, float("nan"))
        return real(state, row)
    engine._draw = draw
    out = engine.generate(reqs)
    assert out[1].finish_reason == "error" and "non-finite logits" in out[1].error and out[1].token_ids == \
        clean[1].token_ids[:1]
    for i in (0, 2):  # the others are untouched
        assert out[i].error is None and out[i].token_ids == clean[i].token_ids
