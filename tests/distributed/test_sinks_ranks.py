"""At TP=2 (two spawned gloo ranks) only global rank 0 writes TensorBoard events and log lines name
their rank: one event file, holding the run's step records; each rank's messages carry its prefix."""
from __future__ import annotations

import glob
import io
import os

import pytest

from tpinv.testing import run_ranks

BASE = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=8, micro_batch=4, steps=2, lr=1e-2, warmup=1,
            eval_every=0, log_level="debug")


def _run(rank, world, tb_dir):
    from tpinv.distributed.parallel import ParallelDims
    from tpinv.training import TrainConfig, train
    from tpinv.training import logs
    err = io.StringIO()
    real = logs.configure_logging

    def capture(level, **kw):  # the trainer's messages of this rank, into a buffer
        return real(level, **dict(kw, stream=err))
    import tpinv.training.loop as loop
    loop.configure_logging = capture
    result = train(TrainConfig(**dict(BASE, tensorboard_dir=tb_dir)), ParallelDims(tp=2).build(), stream=io.StringIO())
    return {"history": result["history"], "err": err.getvalue()}


@pytest.mark.slow
def test_only_rank_zero_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    tb = str(tmp_path / "tb")
    out = run_ranks(_run, 2, tb, timeout=240)
    files = glob.glob(os.path.join(tb, "events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(tb, size_guidance={"tensors": 0})
    acc.Reload()
    loss = {e.step: float(make_ndarray(e.tensor_proto)) for e in acc.Tensors("train/loss")}
    assert loss == {r["step"]: r["loss"] for r in out[0]["history"]}
    assert "[rank 0/2 tp 0/2 dp 0/1] INFO tpinv.training: metrics sink tensorboard:" in out[0]["err"]
    assert "[rank 1/2 tp 1/2 dp 0/1] DEBUG tpinv.training: built qwen3-tiny" in out[1]["err"]
    assert "metrics sink" not in out[1]["err"]  # the control: rank 1 opened no sink
