"""SIGTERM to one rank of a running 2-rank job (``--exit-signal-handler``): both ranks finish the
same step, save a complete checkpoint and exit with status 0; resumed with ``--load`` the run
ends with the weights of an uninterrupted one.  ``--keep-last 1`` leaves only that checkpoint.

Real processes (``launch/pretrain.py`` started as the two ranks of a gloo world) and a real
signal, sent while the steps run.
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tpinv.testing import free_port, num_threads
from tpinv.training import TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "launch", "pretrain.py")
BASE = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=4, micro_batch=2, steps=40, lr=1e-2, warmup=2,
            eval_every=0)


def _flags(cfg):
    return [f for k, v in cfg.items() for f in ("--" + k.replace("_", "-"), str(v))]


def _steps_logged(log_dir) -> list[dict]:
    path = os.path.join(log_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    lines = open(path, encoding="utf-8").read().splitlines()
    return [json.loads(line) for line in lines[:-1] if line]  # the last line may be half written


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_and_the_run_resumes_bitwise(tmp_path):
    save, log = str(tmp_path / "ck"), str(tmp_path / "log")
    cmd = [sys.executable, PRETRAIN, "--tp", "2", "--threads", "1", "--no-progress", "--save", save,
           "--save-every", "2", "--keep-last", "1", "--exit-signal-handler", "--log-dir", log] + _flags(BASE)
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        deadline = time.monotonic() + 240
        while not any(r.get("event") == "step" and r["step"] >= 3 for r in _steps_logged(log)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run did not start"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)  # one rank only: the other learns it at the step boundary
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    records = [json.loads(line) for line in open(os.path.join(log, "metrics.jsonl"), encoding="utf-8")]
    stop = [r for r in records if r["event"] == "exit_signal"]
    assert len(stop) == 1 and 3 <= stop[0]["step"] < BASE["steps"], records[-3:]
    stopped = stop[0]["step"]
    assert open(os.path.join(save, "latest")).read().strip() == f"step_{stopped:08d}"
    assert sorted(n for n in os.listdir(save) if n.startswith("step_")) == [f"step_{stopped:08d}"]  # keep-last 1

    with num_threads(1):
        full = Trainer(TrainConfig(**BASE), stream=io.StringIO()).run()
        at_signal = Trainer(TrainConfig(**dict(BASE, load=save)), stream=io.StringIO()).weights_sha256()
        resumed = Trainer(TrainConfig(**dict(BASE, load=save)), stream=io.StringIO()).run()
    assert resumed["history"][0]["step"] == stopped + 1
    assert resumed["weights_sha256"] == full["weights_sha256"] and resumed["master_sha256"] == full["master_sha256"]
    assert at_signal != full["weights_sha256"]  # control: the checkpoint is not already the end state
