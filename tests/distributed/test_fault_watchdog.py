"""A rank that stops answering is named: before each step a monitored barrier (gloo) with the
run's ``dist_timeout`` reports which ranks did not arrive, instead of every peer blocking for
the process group's timeout."""
from __future__ import annotations

import io
import time

import pytest

from tpinv.testing import RankFailedError, run_ranks

TINY = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=4, micro_batch=4, steps=3, lr=1e-2, warmup=1,
            eval_every=0)
# Long enough that two ranks of the control, on a loaded 2-core machine, always meet within it;
# the frozen rank sleeps far longer.
DIST_TIMEOUT = 8.0


def _frozen_rank(rank, world_size, freeze):
    from tpinv.distributed.parallel import ParallelDims
    from tpinv.training import TrainConfig, Trainer
    trainer = Trainer(TrainConfig(**dict(TINY, dist_timeout=DIST_TIMEOUT)), ParallelDims(tp=2).build(), stream=io.StringIO())
    real = trainer.train_step

    def step():
        if freeze and rank == 1 and trainer.step == 1:
            time.sleep(30)  # frozen before step 2
        return real()
    trainer.train_step = step
    return trainer.run()["step"]


@pytest.mark.slow
def test_frozen_rank_is_named():
    assert run_ranks(_frozen_rank, 2, False, timeout=120) == [3, 3]  # control: no freeze, the run ends
    start = time.monotonic()
    with pytest.raises(RankFailedError) as e:
        run_ranks(_frozen_rank, 2, True, timeout=120)
    text = str(e.value)
    assert f"step 2: a rank stopped answering within --dist-timeout {DIST_TIMEOUT:g} s" in text and "1" in text, text
    assert "Ranks 1 failed to pass monitoredBarrier" in text or "Rank 1 failed" in text, text
    assert time.monotonic() - start < 60
