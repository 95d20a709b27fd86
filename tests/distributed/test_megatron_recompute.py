"""megatron-core's own activation recompute (TransformerConfig recompute_granularity "full" with
recompute_method "uniform"/"block", and "selective") on a GPTModel built with the tpinv spec: the
losses and every parameter gradient are the bits of the run without recompute, at TP 1 and 2, and
the same at both TP sizes -- with tpinv's invariant dropout on (the GPT-2-style config, p=0.1) and
off (the Llama-style config).

Controls, different by construction: with the dropout not told about the recompute
(``/no-replay``), a recomputed dropout draws the next call's mask, so the gradients (and the next
step's loss) change.  megatron's checkpoint calls are counted (the recompute ran), and the bytes
saved for backward fall from none to selective to full.
"""
import pytest

pytest.importorskip("megatron.core")

import megatron_recompute  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks  # noqa: E402

KINDS = ("gpt2", "llama")
SETTINGS = ("none", "full-uniform-1", "full-uniform-2", "full-block-1", "selective")
RUNS = [(k, s) for k in KINDS for s in SETTINGS] + [("gpt2", "full-uniform-1/no-replay")]
#: megatron checkpoint regions entered per step (2 layers): a layer group, or each layer's attention core.
PER_STEP = {"none": 0, "full-uniform-1": 2, "full-uniform-2": 1, "full-block-1": 1, "selective": 2}


@pytest.fixture(scope="module")
def results():
    return {tp: run_ranks(megatron_recompute.worker, tp, RUNS, timeout=500)[0] for tp in (1, 2)}


def _assert_same(got, ref, what):
    assert_same_bits(got[0], ref[0], f"{what}: losses")
    assert got[1].keys() == ref[1].keys() and len(ref[1]) > 10
    for name in ref[1]:
        assert_same_bits(got[1][name], ref[1][name], f"{what}: grad of {name}")


@pytest.mark.slow
def test_megatron_recompute_same_bits_and_tp_invariant(results):
    for kind in KINDS:
        ref = results[1][(kind, "none")]
        for tp in (1, 2):
            for setting in SETTINGS:
                got = results[tp][(kind, setting)]
                assert got[2] == PER_STEP[setting] * megatron_recompute.STEPS, f"{kind} {setting} TP={tp}"
                _assert_same(got, ref, f"{kind} {setting} at TP={tp} vs no recompute at TP=1")


@pytest.mark.slow
def test_control_dropout_not_replayed_under_recompute_differs(results):
    for tp in (1, 2):
        ref, got = results[tp][("gpt2", "none")], results[tp][("gpt2", "full-uniform-1/no-replay")]
        assert got[2] == PER_STEP["full-uniform-1"] * megatron_recompute.STEPS
        assert_same_bits(got[0][0], ref[0][0], "first loss (the first forward draws the same masks)")
        assert_bits_differ(got[0][1], ref[0][1], f"second loss at TP={tp} (the counters moved twice)")
        name = "decoder.layers.0.mlp.linear_fc1.weight"
        assert_bits_differ(got[1][name], ref[1][name], f"grad of {name} at TP={tp}")


@pytest.mark.slow
def test_megatron_recompute_lowers_saved_bytes(results):
    for kind in KINDS:
        saved = {s: results[1][(kind, s)][3] for s in SETTINGS}
        assert saved["full-uniform-2"] < saved["full-uniform-1"] < saved["selective"] < saved["none"], saved
        assert saved["full-uniform-1"] < saved["full-block-1"] < saved["none"], saved
