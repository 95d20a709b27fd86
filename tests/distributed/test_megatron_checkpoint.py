"""megatron's dist_checkpointing with tpinv layers: a GPT-2-style model trained 2 steps and saved
at TP=2 loads at TP=1 with the same weight bits, and training resumes on the same curve (losses,
grad norms, weights) as resuming at TP=2."""
import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")

import megatron_train  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow


def test_save_at_tp2_load_at_tp1(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    at2 = run_ranks(megatron_train.checkpoint_worker, 2, str(ckpt), True, timeout=300)[0]
    at1 = run_ranks(megatron_train.checkpoint_worker, 1, str(ckpt), False, timeout=300)[0]
    loaded2, losses2, norms2, after2, _ = at2
    loaded1, losses1, norms1, after1, fresh1 = at1
    assert loaded1.keys() == loaded2.keys() and len(loaded1) > 10
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert_bits_differ(loaded1[name], fresh1[name], "loaded vs freshly initialised weights (the load ran)")
    for n in loaded1:
        assert_same_bits(loaded1[n], loaded2[n], f"{n} loaded at TP=1 vs TP=2")
        assert_same_bits(after1[n], after2[n], f"{n} after resuming at TP=1 vs TP=2")
    assert_same_bits(torch.stack(losses1), torch.stack(losses2), "resumed losses")
    assert norms1 == norms2
