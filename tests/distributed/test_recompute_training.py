"""Training with activation recompute at TP 1, 2, 4 (with and without sequence parallelism): the
per-step losses, gradient norms and final weights of the run without recompute, bit for bit.

Each run counts the checkpointed regions it entered (the recompute ran).  Control, different by
construction: a recompute whose second forward scales its input by 1 + 2**-4 at TP=2 leaves the
first step's loss as it is but changes its gradient norm and the final weights.
"""
from __future__ import annotations

import io

import pytest

from tpinv.testing import run_ranks
from tpinv.testing.runs import assert_same_run, run_summary

BASE = dict(model="qwen3-tiny", digits=1, seq_len=8, global_batch=8, micro_batch=4, steps=3, lr=1e-2, warmup=1,
            eval_every=0)
SELECTIVE = dict(recompute_granularity="selective")
UNIFORM1 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
UNIFORM2 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
BLOCK1 = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
SP = dict(sequence_parallel=True)


def _perturbed(real):
    def checkpointed(fn, *args, **kwargs):
        runs = []

        def twice(*a, **k):
            runs.append(1)
            if len(runs) > 1:  # the recompute: the layers' input scaled
                i = next(j for j, x in enumerate(a) if hasattr(x, "dtype") and x.is_floating_point())
                a = a[:i] + (a[i] * (1 + 2 ** -4),) + a[i + 1:]
            return fn(*a, **k)
        return real(twice, *args, **kwargs)
    return checkpointed


def run_configs(rank, world_size, configs):
    """Train each ``(tp, overrides, perturb)``; rank 0 returns curves, hashes and checkpoint counts."""
    import tpinv.models.transformer as transformer
    from tpinv.distributed.parallel import ParallelDims
    from tpinv.training import TrainConfig, train

    real = transformer.checkpointed
    out = []
    for tp, overrides, perturb in configs:
        entered = []

        def counted(fn, *args, _inner=_perturbed(real) if perturb else real, **kwargs):
            entered.append(1)
            return _inner(fn, *args, **kwargs)
        transformer.checkpointed = counted
        try:
            result = train(TrainConfig(**dict(BASE, **overrides)), ParallelDims(tp=tp).build(), stream=io.StringIO())
        finally:
            transformer.checkpointed = real
        out.append(run_summary(result, checkpoints=len(entered)))
    return out if rank == 0 else None



@pytest.mark.slow
def test_recompute_keeps_the_curve_at_every_tp():
    ref, uniform1, selective1 = run_ranks(run_configs, 1, [(1, {}, False), (1, UNIFORM1, False),
                                                            (1, SELECTIVE, False)], timeout=400)[0]
    selective2, block2_sp, perturbed2 = run_ranks(run_configs, 2, [
        (2, SELECTIVE, False), (2, dict(BLOCK1, **SP), False), (2, UNIFORM1, True)], timeout=400)[0]
    uniform4_sp, selective4_sp = run_ranks(run_configs, 4, [(4, dict(UNIFORM2, **SP), False),
                                                            (4, dict(SELECTIVE, **SP), False)], timeout=400)[0]
    micro = 3 * 2  # steps x micro-batches per step (DP=1)
    assert ref["checkpoints"] == 0
    runs = {"TP=1 full uniform 1": (uniform1, 2 * micro), "TP=1 selective": (selective1, 2 * micro),
            "TP=2 selective": (selective2, 2 * micro), "TP=2 SP full block 1": (block2_sp, micro),
            "TP=4 SP full uniform 2": (uniform4_sp, micro), "TP=4 SP selective": (selective4_sp, 2 * micro)}
    for where, (run, checkpoints) in runs.items():
        assert run["checkpoints"] == checkpoints, f"{where}: {run['checkpoints']} checkpointed regions"
        assert_same_run(run, ref, f"{where} vs TP=1 without recompute")
    # control: a recompute that is not the forward it replaces
    assert perturbed2["checkpoints"] == 2 * micro
    assert perturbed2["curve"][0][1] == ref["curve"][0][1], "the first forward is not perturbed"
    assert perturbed2["curve"][0][2] != ref["curve"][0][2] and perturbed2["sha"] != ref["sha"]
