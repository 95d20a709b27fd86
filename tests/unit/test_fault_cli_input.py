"""Bad input to the user commands, refused where a user can act on it: ``launch/generate.py``'s
request-default flags before the model is built, its error results naming the file's line (blank
lines counted), its exit status when no line could be generated; ``tools/mismatch_report.py``
and ``tools/check_invariance.py`` refusing a model source or TP size before any rank starts;
every command naming a training checkpoint as such (``tools/export_checkpoint.py`` makes a model
of it); the main job (``launch/train_demo.py``) refusing its bad flags before any of its runs."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tpinv.testing import num_threads
from tpinv.testing.scripts import REPO_ROOT, load_script



@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with num_threads(1):
        yield


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("flags, want", [
    (["--top-k", "-1"], r"top_k=-1: expected an int >= 0"),
    (["--temperature", "-1"], r"temperature=-1.0"),
    (["--max-tokens", "0"], r"max_tokens=0: expected an int >= 1"),
    (["--top-logprobs", "1000"], r"top_logprobs=1000: expected an int in \[0, vocab_size=256\]"),
    (["--eos-token-id", "999"], r"--eos-token-id 999: expected a token id below vocab_size=256"),
    (["--model", "runs-that-do-not-exist/"], r"no such directory"),
])
def test_bad_flags_are_refused_before_the_model_is_built(flags, want, tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_ids": [1, 2]}\n')
    from tpinv.engine import Engine
    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("the model was loaded")))
    argv = ["--model", "qwen3-tiny", "--input", str(src), "--output", str(tmp_path / "out.jsonl")] + flags
    assert load_script("launch/generate.py").main(argv) == 1
    line = _one_error_line(capsys)
    assert re.search(want, line), line
    assert not (tmp_path / "out.jsonl").exists()


def test_error_results_name_the_line_of_the_file_and_ids_keep_their_places(tmp_path, capsys):
    lines = ["", '{"prompt_ids": [1, 2], "max_tokens": 2}', "", '{"prompt_ids": [1, 2,',
             '{"prompt": "3+5=", "max_tokens": 2}', '{"prompt_ids": [4, 5], "max_tokens": 2}']
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert load_script("launch/generate.py").main(["--model", "qwen3-tiny", "--input", str(src),
                                               "--output", str(out)]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in results] == [0, 1, 2, 3]            # the non-blank lines' places
    assert [r["error"] is None for r in results] == [True, False, False, True]
    assert results[1]["error"].startswith("line 4: "), results[1]["error"]   # blank lines counted
    assert "--tokenizer" in results[2]["error"] and "prompt_ids" in results[2]["error"]
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith(f"wrote 4 results to {out}: 2 generated, 2 errors (the first, line 4: "), summary
    # the control: the same requests as good lines in the places of the bad ones give the same
    # results in the good lines' places (the ids, hence the sampling streams, are the places)
    good = ["", lines[1], "", '{"prompt_ids": [7], "max_tokens": 2}', '{"prompt_ids": [8], "max_tokens": 2}', lines[5]]
    src.write_text("\n".join(good) + "\n")
    assert load_script("launch/generate.py").main(["--model", "qwen3-tiny", "--input", str(src),
                                               "--output", str(out)]) == 0
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert again[0] == results[0] and again[3] == results[3]
    assert again[1] != results[1]


def test_a_file_of_which_no_line_can_be_generated_fails(tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt": "text without a tokenizer"}\n{"prompt_ids": [1], "bogus": 1}\n')
    assert load_script("launch/generate.py").main(["--model", "qwen3-tiny", "--input", str(src),
                                               "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "0 generated, 2 errors" in err and "error: no request of" in err
    assert len(out.read_text().splitlines()) == 2     # every result is still written


def test_a_training_checkpoint_is_named_as_such_by_every_loader(tmp_path):
    from tpinv.io.loading import load_model, source_kind
    step = tmp_path / "ck" / "step_00000001"
    step.mkdir(parents=True)
    (step / "train_state.json").write_text("{}")
    (tmp_path / "ck" / "latest").write_text("step_00000001")
    for path in (step, tmp_path / "ck"):
        with pytest.raises(ValueError, match="is a training checkpoint.*tools/export_checkpoint.py"):
            source_kind(str(path))
        with pytest.raises(ValueError, match="is a training checkpoint"):
            load_model(str(path))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert source_kind(str(tmp_path / "hf")) == "hf"   # the control: a model directory is one


def _run_tool(*argv, timeout=120):
    return subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=REPO_ROOT))


@pytest.mark.parametrize("tool", ["tools/mismatch_report.py", "tools/check_invariance.py"])
@pytest.mark.parametrize("argv, want", [
    (["--model", "/nonexistent-model-dir"], "model source /nonexistent-model-dir: no such directory"),
    (["--model", "qwen3-tiny", "--tp", "1,3"], "group size 3 is not a power of two"),
    (["--model", "qwen3-tiny", "--tp", "16"], "group size 16 does not divide leaves=8"),
])
def test_tools_refuse_a_model_or_tp_size_before_any_rank(tool, argv, want):
    proc = _run_tool(tool, *argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and want in last, proc.stderr[-2000:]
    assert "spawn" not in proc.stderr.lower() and not proc.stdout.strip(), proc.stdout


def test_mismatch_report_names_a_bad_prompt_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    for text, want in [('{"prompt_ids": [1]}\n\n{"prompt_ids": [1,\n', "line 3: Expecting value"),
                       ('{"prompt_ids": [1]}\n{"prompt_ids": [999]}\n', "line 2: prompt token id 999")]:
        bad.write_text(text)
        proc = _run_tool("tools/mismatch_report.py", "--model", "qwen3-tiny", "--prompts", str(bad))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert want in proc.stderr.strip().splitlines()[-1], proc.stderr


@pytest.mark.parametrize("argv, want", [
    (["to-tpinv", "/nonexistent-hf-dir"], "model source /nonexistent-hf-dir: no such directory"),
    (["to-tpinv", "qwen3-tiny"], "qwen3-tiny is a named config; to-tpinv reads a HF model directory"),
])
def test_convert_names_what_its_source_is(argv, want, tmp_path):
    proc = _run_tool("tools/convert_hf.py", *argv, str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {want}", proc.stderr[-2000:]


@pytest.mark.parametrize("flags, want", [
    (["--micro-batch", "5"], "global_batch=32 must be a multiple of micro_batch * dp = 5 * 1 = 5"),
    (["--steps", "0"], "steps=0: expected a positive int"),
    (["--lr", "-1"], "bad optimizer setting: lr=-1.0"),
    (["--digits", "0"], "digits=0: expected 1..9"),
    (["--model", "nope"], "model source 'nope' is neither a directory nor a named config"),
])
def test_the_main_job_refuses_bad_flags_before_any_run(flags, want, capsys, monkeypatch):
    demo = load_script("launch/train_demo.py")
    monkeypatch.setattr(demo, "_run", lambda *a, **k: pytest.fail("a run was started"))
    assert demo.main(flags) == 1
    line = _one_error_line(capsys)
    assert line.startswith(f"error: {want}"), line


def test_the_main_job_checks_pass_on_its_defaults():
    demo = load_script("launch/train_demo.py")
    demo.check_settings(demo.parse_args([]))   # the control: the README's command is not refused


@pytest.mark.parametrize("flags", [["--seq", "0"], ["--seq", "-5"], ["--seq", "12"], ["--micro-batch", "0"]])
def test_memory_table_refuses_a_sequence_it_cannot_split(flags, capsys):
    with pytest.raises(SystemExit) as stop:
        load_script("tools/memory_table.py").main(flags + ["--models", "qwen3-tiny"])
    assert stop.value.code == 2 and "positive multiple of 8" in capsys.readouterr().err
    assert load_script("tools/memory_table.py").main(["--seq", "16", "--models", "qwen3-tiny"]) == 0   # the control
    import torch.distributed as dist
    assert not dist.is_initialized()   # its fake process group is not left behind for the tests after it
