"""Training with hidden dropout 0.1 (spawned gloo ranks): one loss curve and one set of weights.

The same global batch at TP 1, 2 and 4, with ``--sequence-parallel``, and at DP 1 and 2
gives the same per-step hex losses, gradient norms and final weights (model and fp32
masters): each row's masks key on its global sample index, each token's on its column.
Controls: dropout 0 gives another curve (dropout ran); the same model with torch's RNG
dropout in place of the keyed masks gives another curve at TP1xDP2 than at TP1xDP1 (each
rank's generator starts from the same state, so rank 1's micro-batches get the masks of
rank 0's, not the ones they get after rank 0's draws in one process).
"""
from __future__ import annotations

import io

import pytest

from tpinv.testing import run_ranks
from tpinv.testing.runs import assert_runs_differ, assert_same_run, run_summary
from tpinv.training import TrainConfig

BASE = dict(model="qwen3-tiny", digits=1, seq_len=8, global_batch=8, micro_batch=2, steps=3, lr=1e-2,
            warmup=1, eval_every=0, dtype="fp32", hidden_dropout=0.1)


class _TorchDropout:
    """The control: ``F.dropout`` (torch's generator) in place of the keyed masks."""

    def __init__(self, p, seed, sample_ids, first_column=0):
        self.p = p

    def __call__(self, x, site):
        import torch.nn.functional as F
        return F.dropout(x, self.p, training=True)


def run_configs(rank, world_size, configs):
    """Run each ``(tp, overrides)`` on this world; rank 0 returns the curves and hashes."""
    import tpinv.models.transformer as transformer
    from tpinv.distributed.parallel import ParallelDims
    from tpinv.training import train
    out = []
    for tp, overrides in configs:
        overrides = dict(overrides)
        keyed = transformer.TokenDropout
        if overrides.pop("torch_dropout", False):
            transformer.TokenDropout = _TorchDropout
        try:
            result = train(TrainConfig(**dict(BASE, **overrides)), ParallelDims(tp=tp).build(),
                           stream=io.StringIO())
        finally:
            transformer.TokenDropout = keyed
        out.append(run_summary(result))
    return out if rank == 0 else None




@pytest.mark.slow
def test_dropout_training_same_bits_at_every_layout():
    sp, torch_drop = dict(sequence_parallel=True), dict(torch_dropout=True)
    tp2dp2, tp4, sp2dp2, sp4 = run_ranks(run_configs, 4, [(2, {}), (4, {}), (2, sp), (4, sp)], timeout=600)[0]
    tp1dp2, tp2, torch_dp2 = run_ranks(run_configs, 2, [(1, {}), (2, {}), (1, torch_drop)], timeout=400)[0]
    tp1, off, torch_dp1 = run_ranks(run_configs, 1, [(1, {}), (1, dict(hidden_dropout=0.0)), (1, torch_drop)],
                                    timeout=300)[0]
    assert len(tp1["curve"]) == BASE["steps"]
    assert_same_run(tp2, tp1, "TP2 vs TP1")
    assert_same_run(tp4, tp1, "TP4 vs TP1")
    assert_same_run(tp1dp2, tp1, "TP1xDP2 vs TP1xDP1")
    assert_same_run(tp2dp2, tp1, "TP2xDP2 vs TP1xDP1")
    assert_same_run(sp2dp2, tp1, "TP2xDP2 sequence-parallel vs TP1xDP1")
    assert_same_run(sp4, tp1, "TP4 sequence-parallel vs TP1xDP1")
    assert_runs_differ(off, tp1, "dropout 0 vs 0.1")
    assert_runs_differ(torch_dp2, torch_dp1, "torch's RNG dropout, TP1xDP2 vs TP1xDP1")


def test_vanilla_with_dropout_is_refused():
    with pytest.raises(NotImplementedError, match="vanilla"):
        TrainConfig(**dict(BASE, vanilla=True)).check(1)
