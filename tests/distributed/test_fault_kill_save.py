"""SIGKILL at random moments of a checkpoint save never loses or corrupts a checkpoint.

One process trains a step and saves; it then re-runs the save of a later step in a forked child
24 times, SIGKILLing the child after a random delay spread over the time one save takes (the
sharded write, the checksums, ``train_state.json``, the rename and ``latest``: the same code a
multi-rank save runs, where rank 0 alone publishes).  After every kill ``latest`` names a
complete checkpoint whose files verify and whose tensors read back, and so does every
``step_*`` directory.  At the end two ranks resume at TP=2 from what the kills left (the
one-process shards resharded) and save again, which removes what the kills left.
"""
from __future__ import annotations

import io
import os
import random
import signal
import time

import pytest

from tpinv.testing import run_ranks

TRIALS = 24
TINY = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=4, micro_batch=4, steps=1, lr=1e-2, warmup=1,
            eval_every=0)


def _verify(root: str, only=None) -> str:
    """Check ``latest`` and every complete step directory (of ``only``, if given); return ``latest``'s name."""
    from tpinv.training.export import read_full_tensors
    from tpinv.training.ckpt_files import read_train_state, resolve_checkpoint, verify_files
    latest = resolve_checkpoint(root)
    for name in os.listdir(root):
        if name.startswith("step_") and "." not in name and (only is None or name in only):
            step_dir = os.path.join(root, name)
            verify_files(step_dir, read_train_state(step_dir))
            for prefix in ("model/", "master/", "exp_avg/", "exp_avg_sq/"):
                assert read_full_tensors(step_dir, prefix)
    return os.path.basename(latest)


def _kill_saves(rank, world_size, root):
    from tpinv.training import TrainConfig, Trainer
    from tpinv.training.ckpt_files import resolve_checkpoint, step_dir_name
    trainer = Trainer(TrainConfig(**dict(TINY, save=root)), stream=io.StringIO())
    first = trainer.run()

    def write(step):
        trainer.step = step
        trainer.save()
    start = time.perf_counter()
    write(2)
    took = time.perf_counter() - start
    rng, completed, cut = random.Random(0), 0, 0
    for trial in range(TRIALS):
        step = 3 + trial
        pid = os.fork()
        if pid == 0:  # the child saves and is killed
            try:
                write(step)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0, 1.5 * took))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        latest = _verify(root, only={step_dir_name(step), os.path.basename(resolve_checkpoint(root))})
        completed += latest == step_dir_name(step)
        # a save cut short leaves its temp dir (the next save removes it, so count after each kill)
        cut += any(".tmp-" in n or ".old-" in n for n in os.listdir(root))
    trainer.close()
    return {"took": took, "completed": completed, "cut": cut,
            "latest": int(_verify(root).removeprefix("step_")), "first_step": first["step"]}


def _resume(rank, world_size, root):
    from tpinv.distributed.parallel import ParallelDims
    from tpinv.training import TrainConfig, Trainer
    resumed = Trainer(TrainConfig(**dict(TINY, steps=TRIALS + 4, save=root, load=root)), ParallelDims(tp=2).build(),
                      stream=io.StringIO())
    resumed_at = resumed.step
    resumed.train_step()
    resumed.save()
    resumed.close()
    return {"resumed_at": resumed_at, "after": sorted(n for n in os.listdir(root) if ".tmp-" in n or ".old-" in n)}


@pytest.mark.slow
def test_sigkill_during_save_loses_nothing(tmp_path):
    root = str(tmp_path / "ck")
    out = run_ranks(_kill_saves, 1, root, timeout=600, init_group=False)[0]
    out.update(run_ranks(_resume, 2, root, timeout=300)[0])
    # the kills cut saves short (their temp dirs stayed behind) and every check after each held
    assert out["cut"] > 0 and out["completed"] < TRIALS, out
    assert out["first_step"] == 1 and out["resumed_at"] == out["latest"] >= 2 and out["after"] == [], out
