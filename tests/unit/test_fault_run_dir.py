"""No run writes over another: ``--save`` is checked and locked before any step, a second writer
is refused naming the owner, a fresh run into another run's checkpoints is refused unless it
resumes or overwrites, a dead owner's lock and the temp dirs of killed saves are cleaned up."""
from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys

import pytest

from tpinv.io.run_dir import LOCK_FILE, RunDirError, RunLock, claim_run_dir
from tpinv.testing import num_threads
from tpinv.training import TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=4, micro_batch=4, steps=2, lr=1e-2, warmup=1,
            eval_every=0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with num_threads(1):
        yield


def _train(**kw):
    return Trainer(TrainConfig(**dict(TINY, **kw)), stream=io.StringIO()).run()


def _snapshot(root) -> dict:
    """Every file under ``root`` with its bytes."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def test_fresh_run_into_another_runs_checkpoints_is_refused(tmp_path):
    save = str(tmp_path / "ck")
    first = _train(steps=3, save=save, save_every=1)
    before = _snapshot(save)
    with pytest.raises(RunDirError, match=r"already holds another run's checkpoints \(3 step directories, latest "
                                          r"step_00000003\); pass --load .* --overwrite"):
        _train(steps=1, save=save)
    assert _snapshot(save) == before  # nothing moved, 'latest' still names step 3
    resumed = _train(steps=4, save=save, load=save)  # resuming is allowed
    assert [r["step"] for r in resumed["history"]] == [4]
    replaced = _train(steps=1, save=save, overwrite=True)  # so is an explicit overwrite
    assert sorted(os.listdir(save)) == ["latest", "step_00000001"] and first["step"] == 3
    assert replaced["step"] == 1


def test_live_owner_refuses_a_second_writer_and_a_dead_ones_lock_is_taken_over(tmp_path):
    save = tmp_path / "ck"
    save.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"pid": sleeper.pid, "host": socket.gethostname(), "run_id": "other", "since": "then"}
        (save / LOCK_FILE).write_text(json.dumps(lock))
        with pytest.raises(RunDirError, match=rf"being written by another run \(pid {sleeper.pid} on host .*run other"):
            _train(save=str(save))
        assert os.listdir(save) == [LOCK_FILE]  # the owner's lock is left alone
    finally:
        sleeper.kill()
        sleeper.wait()
    _train(save=str(save))  # the owner died: its lock is stale
    assert sorted(os.listdir(save)) == ["latest", "step_00000002"]  # and the lock was released


def test_another_hosts_lock_is_never_broken(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere", "run_id": "x", "since": "t"}))
    with pytest.raises(RunDirError, match="host elsewhere.*remove .*\\.lock"):
        claim_run_dir(str(tmp_path), run_id="me", resume=False, overwrite=False)
    (tmp_path / "sub").mkdir()
    assert RunLock(str(tmp_path / "sub"), "a").acquire().held  # control: a free directory locks


def test_unwritable_save_fails_before_any_step(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    built = []
    import tpinv.training.loop as loop
    real = loop.build_model
    loop.build_model = lambda *a, **k: built.append(1) or real(*a, **k)
    try:
        with pytest.raises(RunDirError, match=r"--save .*file/ck is not writable"):
            Trainer(TrainConfig(**dict(TINY, save=str(blocker / "ck"))), stream=io.StringIO())
    finally:
        loop.build_model = real
    assert built == []


def test_stale_temp_dirs_of_killed_saves_are_cleaned(tmp_path):
    save = tmp_path / "ck"
    _train(steps=1, save=str(save))
    for junk in ("step_00000002.tmp-abc", "step_00000001.old-xyz"):
        (save / junk).mkdir()
        (save / junk / "model").mkdir()
    (save / "latest.tmp-q").write_text("step_00000002\n")
    _train(steps=2, save=str(save), load=str(save))
    assert sorted(os.listdir(save)) == ["latest", "step_00000001", "step_00000002"]


@pytest.mark.slow
def test_two_cli_writers_at_once_one_is_refused_and_nothing_is_lost(tmp_path):
    save = tmp_path / "ck"
    from tpinv.testing import free_port
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "pretrain.py"), "--threads", "1", "--no-progress",
           "--model", "qwen3-tiny", "--digits", "1", "--seq-len", "6", "--global-batch", "4", "--micro-batch", "4",
           "--steps", "4", "--save-every", "1", "--eval-every", "0", "--save", str(save)]
    ports = set()
    while len(ports) < 2:   # two runs at once: two ports
        ports.add(free_port())
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(env, MASTER_PORT=str(port)), cwd=tmp_path) for port in ports]
    outs = [p.communicate(timeout=240) + (p.returncode,) for p in procs]
    ok = [o for o in outs if o[2] == 0]
    refused = [o for o in outs if o[2] != 0]
    assert len(ok) == 1 and len(refused) == 1, outs
    errors = [line for line in refused[0][1].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and ("being written by another run" in errors[0]
                                 or "already holds another run's checkpoints" in errors[0]), refused[0][1]
    assert "saved checkpoint" not in refused[0][0]
    # the winner's four checkpoints are all there, complete, and 'latest' names the last
    assert (save / "latest").read_text().strip() == "step_00000004"
    assert sorted(n for n in os.listdir(save) if n.startswith("step_")) == [f"step_{i:08d}" for i in range(1, 5)]
    resumed = _train(steps=5, save=str(save), load=str(save))
    assert resumed["step"] == 5
