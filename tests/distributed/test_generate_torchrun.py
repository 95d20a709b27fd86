"""launch/generate.py under torchrun at TP=2 writes the TP=1 run's results: the same tokens and
the same bits of every log-prob (fp32 values survive the JSON round trip).  Negative control:
``--vanilla`` (BLAS, SDPA, plain all_reduce) at TP=2 vs TP=1 gives other log-prob bits."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tpinv.testing import assert_bits_differ, assert_same_bits, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUESTS = ['{"id": "a", "prompt_ids": [1, 2, 3, 4, 5]}',
            '{"id": "b", "prompt_ids": [9, 8, 7], "temperature": 0.7, "top_p": 0.9, "seed": 3}',
            '{"id": "c", "prompt_ids": [4, 4, 200, 17, 3, 3, 90]}']


def _generate(tmp_path, tp: int, vanilla: bool) -> list[dict]:
    out = tmp_path / f"out-tp{tp}-{'vanilla' if vanilla else 'tpinv'}.jsonl"
    args = ["launch/generate.py", "--model", "mistral-tiny", "--input", str(tmp_path / "in.jsonl"),
            "--output", str(out), "--max-tokens", "4", "--max-batch", "2", "--init-seed", "5",
            "--temperature", "0"] + (["--vanilla"] if vanilla else [])
    if tp > 1:
        args = ["-m", "torch.distributed.run", "--nproc_per_node", str(tp), "--master_port", str(free_port()),
                "--master_addr", "127.0.0.1"] + args
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"TP={tp} vanilla={vanilla}: {proc.stderr[-3000:]}"
    return [json.loads(line) for line in out.read_text().splitlines()]


def _logprobs(results: list[dict]) -> torch.Tensor:
    return torch.tensor([lp for r in results for lp in r["logprobs"]], dtype=torch.float32)


@pytest.mark.slow
def test_generate_under_torchrun_tp2_equals_tp1(tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join(REQUESTS) + "\n")
    one, two = _generate(tmp_path, 1, False), _generate(tmp_path, 2, False)
    assert [r["id"] for r in two] == ["a", "b", "c"] and all(r["finish_reason"] == "length" for r in two)
    assert [r["token_ids"] for r in two] == [r["token_ids"] for r in one]
    assert_same_bits(_logprobs(two), _logprobs(one), "generate.py log-probs at TP=2 vs TP=1")
    assert_same_bits(torch.tensor([x for r in two for x in r["sampled_logprobs"]], dtype=torch.float32),
                     torch.tensor([x for r in one for x in r["sampled_logprobs"]], dtype=torch.float32),
                     "generate.py sampled log-probs at TP=2 vs TP=1")
    vanilla_one, vanilla_two = _generate(tmp_path, 1, True), _generate(tmp_path, 2, True)
    assert_bits_differ(_logprobs(vanilla_two), _logprobs(vanilla_one), "--vanilla log-probs at TP=2 vs TP=1")
