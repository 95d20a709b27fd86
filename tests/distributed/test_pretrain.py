"""Training at TP 1, 2, 4 (spawned gloo ranks and the torchrun CLI): the same loss curve, bit for bit.

* TP=1, 2, 4 on the same seed and data: identical per-step losses, gradient norms, held-out
  accuracies and final weights (model and fp32 masters); the vanilla control differs between
  TP sizes.
* TP=2 x DP=2 == TP=1 x DP=2 (== TP=1 x DP=1: the micro-batch tree makes DP invariant too).
* Stopped at step k (checkpoint at TP=2) and resumed at TP=2, 1 and 4: the rest of the curve and
  the final weights equal the uninterrupted run; the vanilla control resumed at another TP
  diverges from its own uninterrupted run.
* ``torchrun launch/pretrain.py --tp 2`` prints the per-step hex losses and the weight hash of
  the in-process TP=1 run, writes metrics.jsonl and the loss-curve PNG; bad input exits with
  one ``error: ...`` line; ``python launch/pretrain.py`` without torchrun is one rank of the same
  bits, and ``--tp 2`` there names the torchrun command.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from tpinv.testing import free_port, run_ranks
from tpinv.training import TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "launch", "pretrain.py")
STEPS, STOP = 4, 2
BASE = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=8, micro_batch=4, steps=STEPS, lr=1e-2,
            warmup=2, eval_every=2)


def run_configs(rank, world_size, configs):
    """Run each ``(tp, overrides)`` in turn on this world; rank 0 returns what the asserts need."""
    from tpinv.distributed.parallel import ParallelDims
    from tpinv.training import train
    out = []
    for tp, overrides in configs:
        result = train(TrainConfig(**dict(BASE, **overrides)), ParallelDims(tp=tp).build(), stream=io.StringIO())
        out.append(_summary(result))
    return out if rank == 0 else None


def _summary(result):
    curve = [(r["step"], r["loss_hex"], r["grad_norm_hex"], r.get("heldout_exact")) for r in result["history"]]
    return {"curve": curve, "sha": result["weights_sha256"], "master": result["master_sha256"]}


def _same(a, b, where):
    assert a["curve"] == b["curve"], f"{where}: per-step curves differ"
    assert a["sha"] == b["sha"] and a["master"] == b["master"], f"{where}: final weights differ"


def test_training_is_tp_invariant_and_resumes_at_any_tp(tmp_path):
    ckpt, vckpt = str(tmp_path / "ckpt"), str(tmp_path / "vckpt")
    stop = dict(save=ckpt, save_every=STOP, stop_after=STOP)
    vanilla_at_stop = os.path.join(vckpt, f"step_{STOP:08d}")  # 'latest' names the final save
    # 4 micro-batches (2 per rank at DP=2), fp32 gradients: sums of a few bf16 gradients are
    # often exact in fp32 in any order, fp32 ones are not
    mb2 = dict(micro_batch=2, dtype="fp32")
    tp2, vanilla2, stopped, resumed2, dp2_tp1, vanilla_dp2 = run_ranks(run_configs, 2, [
        (2, {}), (2, dict(vanilla=True, save=vckpt, save_every=STOP)), (2, stop), (2, dict(load=ckpt)),
        (1, mb2), (1, dict(mb2, vanilla=True))], timeout=300)[0]
    tp1, vanilla1, resumed1, vresumed1, dp1, vanilla_dp1 = run_ranks(run_configs, 1, [
        (1, {}), (1, dict(vanilla=True)), (1, dict(load=ckpt)), (1, dict(vanilla=True, load=vanilla_at_stop)),
        (1, mb2), (1, dict(mb2, vanilla=True))], timeout=300)[0]
    tp4, resumed4, dp2_tp2 = run_ranks(run_configs, 4, [(4, {}), (4, dict(load=ckpt)), (2, mb2)], timeout=300)[0]

    assert len(tp1["curve"]) == STEPS and tp1["curve"][-1][3] is not None
    _same(tp2, tp1, "TP=2 vs TP=1")
    _same(tp4, tp1, "TP=4 vs TP=1")
    # negative control: the plain torch/BLAS/all_reduce path changes bits with the TP size
    assert vanilla1["curve"][0][1] != vanilla2["curve"][0][1] and vanilla1["sha"] != vanilla2["sha"]

    _same(dp2_tp2, dp2_tp1, "TP=2 x DP=2 vs TP=1 x DP=2")
    _same(dp2_tp1, dp1, "TP=1 x DP=2 vs TP=1 x DP=1")
    # negative control: the plain chain over micro-batches + all_reduce changes bits with the DP size
    assert vanilla_dp1["curve"] != vanilla_dp2["curve"] and vanilla_dp1["sha"] != vanilla_dp2["sha"]

    assert stopped["curve"] == tp2["curve"][:STOP]
    for tp, resumed in ((2, resumed2), (1, resumed1), (4, resumed4)):
        _same(resumed, {**tp2, "curve": tp2["curve"][STOP:]}, f"resumed at TP={tp}")
    # negative control: the vanilla run resumed at TP=1 from its TP=2 checkpoint leaves its curve
    assert len(vresumed1["curve"]) == STEPS - STOP and vresumed1["curve"] != vanilla2["curve"][STOP:]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def _flags(overrides=None):
    cfg = dict(BASE, **(overrides or {}))
    flags = []
    for key in ("model", "digits", "seq_len", "global_batch", "micro_batch", "steps", "lr", "warmup", "eval_every"):
        flags += ["--" + key.replace("_", "-"), str(cfg[key])]
    return flags


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _torchrun_tp2(log_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", PRETRAIN,
           "--tp", "2", "--threads", "1", "--log-dir", str(log_dir), "--no-progress"] + _flags()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return proc.stdout, [(r["loss_hex"], r["grad_norm_hex"]) for r in records if r["event"] == "step"]


def test_cli_torchrun_tp2_twice_matches_in_process_tp1(tmp_path, one_thread):
    stdout, curve = _torchrun_tp2(tmp_path / "log")
    reference = Trainer(TrainConfig(**BASE), stream=io.StringIO()).run()
    for rec in reference["history"]:
        assert f"({rec['loss_hex']})" in stdout, f"step {rec['step']} loss {rec['loss_hex']} not printed"
    assert f"final weights sha256 {reference['weights_sha256']}" in stdout
    assert curve == [(r["loss_hex"], r["grad_norm_hex"]) for r in reference["history"]]
    assert (tmp_path / "log" / "loss_curve.png").stat().st_size > 1000
    stdout_again, curve_again = _torchrun_tp2(tmp_path / "again")  # the same command twice
    assert curve_again == curve and f"final weights sha256 {reference['weights_sha256']}" in stdout_again


def _cli_error(args, tmp_path):
    env = _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, PRETRAIN, "--threads", "1"] + args, capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr
    return errors[0]


@pytest.mark.parametrize("case", ["tp3", "tp_world", "missing_data", "mismatched_checkpoint"])
def test_cli_bad_input_exits_with_one_error_line(case, tmp_path, one_thread):
    if case == "tp3":
        assert "not a power of two" in _cli_error(["--tp", "3"], tmp_path)
    elif case == "tp_world":
        assert "does not divide the world size 1" in _cli_error(["--tp", "2"], tmp_path)
    elif case == "missing_data":
        assert "not found" in _cli_error(["--data", str(tmp_path / "corpus.txt"), "--steps", "1"], tmp_path)
    else:
        ckpt = tmp_path / "ckpt"
        Trainer(TrainConfig(**dict(BASE, steps=1, save=str(ckpt))), stream=io.StringIO()).run()
        before = sorted(os.listdir(ckpt))
        line = _cli_error(_flags(dict(model="llama-tiny")) + ["--load", str(ckpt), "--save", str(ckpt)], tmp_path)
        assert "different model" in line and "family" in line
        assert sorted(os.listdir(ckpt)) == before


def test_cli_without_torchrun_runs_one_rank_or_names_the_command(tmp_path, one_thread):
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                         "MASTER_PORT")}
    proc = subprocess.run([sys.executable, PRETRAIN, "--threads", "1", "--no-progress"] + _flags(),
                          capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    reference = Trainer(TrainConfig(**BASE), stream=io.StringIO()).run()   # the torchrun TP=1 run's bits
    assert f"final weights sha256 {reference['weights_sha256']}" in proc.stdout
    proc = subprocess.run([sys.executable, PRETRAIN, "--tp", "2"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and errors == [
        "error: --tp 2 needs 2 ranks: start it with torchrun --nproc-per-node 2 launch/pretrain.py ..."], proc.stderr
