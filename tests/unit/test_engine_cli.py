"""The thin front ends: launch/generate.py (jsonl in, jsonl out) and tools/mismatch_report.py (in-process, TP=1).

The CLI's results are the Python API's, bit for bit (log-probs survive the JSON round trip);
a bad line becomes that line's error result and leaves the others unchanged.  The report's
pieces run on in-process rollouts: the invariant rows show token_mult_prob_error 1.0, K3 KL 0
and all tokens bitwise equal; the vanilla rows (negative control) do not.
"""
from __future__ import annotations

import io
import json
import os

import pytest
import torch

from tpinv.engine import Engine, Request, SamplingParams
from tpinv.testing import assert_same_bits, num_threads
from tpinv.testing.scripts import load_script



@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with num_threads(1):   # tiny ops: a thread pool only adds overhead
        yield


def test_generate_cli_matches_the_python_api(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    lines = ['{"id": "a", "prompt_ids": [1, 2, 3, 4, 5], "max_tokens": 3}',
             'not json',
             '{"id": "b", "prompt_ids": [9, 8, 7], "temperature": 0.7, "top_p": 0.9, "seed": 3}',
             '{"id": "c", "prompt_ids": [300]}',
             '{"id": "d", "prompt_ids": [5], "colour": "red"}',
             '{"id": "e", "prompt_ids": [4, 4], "temperature": 0, "top_logprobs": 2}']
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    gen = load_script("launch/generate.py")
    rc = gen.main(["--model", "mistral-tiny", "--input", str(tmp_path / "in.jsonl"), "--output",
                   str(tmp_path / "out.jsonl"), "--max-tokens", "4", "--max-batch", "2", "--init-seed", "5"])
    assert rc == 0
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["id"] for o in out] == ["a", 1, "b", "c", 4, "e"]
    assert [o["finish_reason"] for o in out] == ["length", "error", "length", "error", "error", "length"]
    assert "line 1" in out[1]["error"] and "vocab_size=256" in out[3]["error"] and "colour" in out[4]["error"]
    api = Engine.load("mistral-tiny", init_seed=5, max_batch=3).generate([
        Request("a", [1, 2, 3, 4, 5], max_tokens=3),
        Request("b", [9, 8, 7], max_tokens=4, sampling=SamplingParams(0.7, top_p=0.9, seed=3)),
        Request("e", [4, 4], max_tokens=4, sampling=SamplingParams(0.0), top_logprobs=2)])
    for o, r in zip([out[0], out[2], out[5]], api):
        assert o["token_ids"] == r.token_ids
        assert_same_bits(torch.tensor(o["logprobs"], dtype=torch.float32), r.logprobs,
                         "torch.tensor(o['logprobs'], dtype=torch.float32)")
        assert_same_bits(torch.tensor(o["sampled_logprobs"], dtype=torch.float32), r.sampled_logprobs,
                         "torch.tensor(o['sampled_logprobs'], dtype=torch...")
    assert len(out[5]["top_logprobs"][0]) == 2


def test_mismatch_report_pieces(tmp_path):
    tool = load_script("tools/mismatch_report.py")
    args = tool.build_parser().parse_args(["--model", "qwen3-tiny", "--dtype", "bf16", "--weight-scale", "5",
                                           "--batch", "1,3", "--num-prompts", "3", "--max-tokens", "5",
                                           "--prompt-len", "3,9", "--vanilla"])
    spec = {"model": args.model, "dtype": tool.cli_dtype(args.dtype), "init_seed": 0, "weight_scale": 5.0, "seed": 42}
    from tpinv.io.loading import check_source
    requests = tool.make_requests(args, check_source(args.model))
    modes = [False, True]
    gens = {1: tool.engine_rollouts(None, spec, args.batch, modes, requests)}
    rollouts = {(v, 1, b): (v, [(o[0], o[1]) for o in gens[1][v, b]]) for v in modes for b in args.batch}
    scores = {1: tool.trainer_scores(None, spec, rollouts)}
    report = tool.summarize(requests, gens, scores, modes, [1], args.batch, [1])
    invariant = [r for r in report["rows"] if r["mode"] == "invariant"]
    vanilla = [r for r in report["rows"] if r["mode"] == "vanilla"]
    assert len(invariant) == len(vanilla) == 2
    for r in invariant:
        assert (r["token_mult_prob_error"], r["k3_kl"], r["max_abs_logprob_diff"], r["fraction_bitwise_equal"]) == \
            (1.0, 0.0, 0.0, 1.0)
        assert r["tokens"] == 15
    assert any(r["token_mult_prob_error"] > 1.0 for r in vanilla)           # negative control
    assert report["grid"]["invariant"]["unique_outputs_per_prompt"] == [1, 1, 1]
    assert report["grid"]["invariant"]["avg_max_prob_divergence"] == 0.0
    assert set(report["prob_diffs"]["invariant"]) == {0.0}
    text = io.StringIO()
    tool.print_table(report, file=text)
    assert "invariant" in text.getvalue() and "vanilla" in text.getvalue()
    tool.save_histogram(report["prob_diffs"], str(tmp_path / "hist.png"))
    assert (tmp_path / "hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(report)
