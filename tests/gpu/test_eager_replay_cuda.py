"""Eager replay on CUDA: training steps of a Qwen3-0.6B-shaped model (two layers) whose decoder
layers replay their recorded programs -- Triton launches through their C entries with addresses
patched, allocations pooled -- have the bits of the modular steps (loss and every gradient) on
batches other than the recorded one.  Control: a program with one launch removed (the layer's last
kernel) is caught by its check on poisoned allocations and turned off, the step still returning the
modular bits.  ``tests/unit/test_eager_replay.py`` holds the CPU checks."""
from __future__ import annotations

import pytest
import torch

from tpinv.models import Transformer, get_config
from tpinv.models import replayed_layer as rl
from tpinv.testing import assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model():
    torch.manual_seed(0)
    return Transformer(get_config("qwen3-0.6b", num_layers=2, vocab_size=4096, dtype=torch.bfloat16)).cuda()


def _step(model, seed: int, replay: bool):
    rl.REPLAY[0] = replay
    try:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 4096, (2, 512), generator=gen).cuda()
        targets = torch.randint(0, 4096, (2, 512), generator=gen).cuda()
        model.zero_grad(set_to_none=True)
        loss = model.loss(tokens, targets)
        loss.backward(torch.rand(2, 512, generator=gen).cuda())
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    finally:
        rl.REPLAY[0] = True


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert_same_bits(u, v, f"tensor {i}")


def test_replayed_steps_have_the_modular_bits_on_cuda():
    model, ref = _model(), _model()
    before = rl.replay_counts()
    for seed in range(5):
        _assert_same(_step(model, seed, True), _step(ref, seed, False))
    counts = {k: rl.replay_counts()[k] - before[k] for k in before}
    assert counts == {"record": 2, "check": 2, "replay": 4, "refused": 0}
    for layer in model.layers:
        (entry,) = layer.replay.entries.values()
        assert entry.state == "ready"
        assert entry.forward.launches >= 10 and entry.backward.launches >= 20
        assert any(s.name == "pool" for s in entry.forward.steps + entry.backward.steps)


def test_a_program_missing_a_launch_is_caught_on_cuda():
    model, ref = _model(), _model()
    for seed in range(2):                                # first sight, record
        _assert_same(_step(model, seed, True), _step(ref, seed, False))
    entry = next(iter(model.layers[1].replay.entries.values()))
    assert entry.state == "check"
    launches = [s for s in entry.forward.steps if s.kind == "launch"]
    entry.forward.steps.remove(launches[-1])             # the MLP's down projection: its output stays poisoned
    with pytest.warns(RuntimeWarning, match="forward output differed"):
        _assert_same(_step(model, 2, True), _step(ref, 2, False))
    assert entry.state == "refused"
    _assert_same(_step(model, 3, True), _step(ref, 3, False))
