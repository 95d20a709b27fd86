"""``launch/rl.py``: the rollout and the trainer at different TP sizes agree on every log-prob bit.

Short GRPO runs on spawned gloo ranks (rollout TP=2 / trainer TP=1, the reverse, and rollout TP=4 /
trainer TP=1, the layout of an engine at TP=4 beside a trainer at TP=1):
every step of the tpinv run has K3 KL exactly 0, token_mult_prob_error exactly 1.0 and all
log-probs bitwise equal; the vanilla run beside it (same weights, the plain forward on both
sides) has non-zero KL and some differing log-probs (the negative control).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RL = os.path.join(ROOT, "launch", "rl.py")


@pytest.mark.slow
@pytest.mark.parametrize("rollout_tp,trainer_tp", [(2, 1), (1, 2), (4, 1)])
def test_rl_loop_is_on_policy_at_different_tp_sizes(tmp_path, rollout_tp, trainer_tp):
    out = tmp_path / "rl"
    proc = subprocess.run([sys.executable, RL, "--steps", "2", "--sft-steps", "3", "--prompts", "3", "--group", "2",
                           "--correction", "mis", "--rollout-tp", str(rollout_tp), "--trainer-tp", str(trainer_tp), "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tp = [r for r in history if r["run"] == "tpinv"]
    van = [r for r in history if r["run"] == "vanilla"]
    assert len(tp) == len(van) == 2
    for r in tp:
        assert r["k3_kl"] == 0.0 and r["token_mult_prob_error"] == 1.0 and r["frac_bitwise_equal"] == 1.0, r
        assert r["is_weight_min"] == r["is_weight_max"] == 1.0, r  # the corrections are the identity
    assert all(r["token_mult_prob_error"] > 1.0 and r["frac_bitwise_equal"] < 1.0 for r in van), van
    assert all(r["is_weight_min"] < 1.0 < r["is_weight_max"] for r in van), van
    assert (out / "rl_curves.png").stat().st_size > 0


def _refused(*flags):
    proc = subprocess.run([sys.executable, RL, *flags], capture_output=True, text=True, timeout=120, cwd=ROOT)
    return proc.returncode, proc.stderr


def test_gpu_flags_without_gpus_are_refused_before_any_rank_starts():
    import torch
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs --backend nccl asks for")
    code, err = _refused("--backend", "nccl")
    assert code == 2 and "--backend nccl runs 2 ranks on 2 GPUs" in err, err
    code, err = _refused("--cuda-graph")
    assert code == 2 and "--cuda-graph needs --backend nccl" in err, err
