"""Eager replay (:mod:`tpinv.ops.replay`, :mod:`tpinv.models.replayed_layer`) on the CPU kernels.

A block of tpinv layers (RMSNorm, the q/k/v-free MLP, a residual) replayed from its recorded
program gives the modular code's bytes -- output, input gradient, every parameter gradient,
gradients accumulated over micro-batches -- on inputs other than the recorded ones; the calls go
first sight -> record -> check -> replay, and the replay really ran (its counter moves, the
modules are not entered).  Controls: a program missing one recorded step (the copy into a new
buffer) is caught by its check on poisoned allocations and turned off, the call still returning
the modular bytes; the decoder layer on the CPU is refused (its reference attention reads
positions on the host) with the reason named; watched calls (no grad, hooks, a dispatch mode)
run the modular code.  The CUDA programs (launches, pooled allocations) are checked in
``tests/gpu/test_eager_replay_cuda.py``.
"""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from tpinv.ops.replay import Recording, ReplayRefused
from tpinv.models import Transformer, get_config
from tpinv.models import replayed_layer as rl
from tpinv.models.transformer import MLP, LayerConfig, _norm
from tpinv.testing import assert_bits_differ, assert_same_bits

ARGS = get_config("qwen3-tiny")


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch):
    monkeypatch.setattr(rl, "REPLAY_DEVICES", {"cpu"})
    monkeypatch.setattr(rl, "REPLAY", [True])


class Block(torch.nn.Module):
    """RMSNorm, MLP and a residual, scaled by an input: a block whose CPU kernels read no device value."""

    def __init__(self):
        super().__init__()
        config = LayerConfig(params_dtype=ARGS.dtype, tpinv_leaves=8, tpinv_row_strategy="tree")
        self.norm = _norm(ARGS, config, None)
        self.mlp = MLP(ARGS, config, None)
        self.replay = rl.ReplayedLayer("Block")

    def modular(self, x, scale):
        return x + self.mlp(self.norm(x)) * scale

    def forward(self, x, scale):
        if rl.eligible(x, self):
            return self.replay(self.modular, x, (scale,), tuple(self.parameters()))
        return self.modular(x, scale)


def _block():
    torch.manual_seed(0)
    return Block()


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, ARGS.hidden_size, generator=gen).to(ARGS.dtype).requires_grad_()
    scale = torch.rand(ARGS.hidden_size, generator=gen).to(ARGS.dtype)
    g = torch.randn(3, 5, ARGS.hidden_size, generator=gen).to(ARGS.dtype)
    return x, scale, g


def _step(block, seed, replay: bool, zero=True):
    rl.REPLAY[0] = replay
    x, scale, g = _inputs(seed)
    if zero:
        block.zero_grad(set_to_none=True)
    y = block(x, scale)
    y.backward(g)
    return [y.detach(), x.grad] + [p.grad.clone() for p in block.parameters()]


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert_same_bits(u, v, f"result {i}")


def test_block_replays_the_modular_bits():
    block, ref = _block(), _block()
    before = rl.replay_counts()
    for seed in range(6):
        _assert_same(_step(block, seed, True), _step(ref, seed, False))
    counts = {k: rl.replay_counts()[k] - before[k] for k in before}
    assert counts == {"record": 1, "check": 1, "replay": 3, "refused": 0}
    (entry,) = block.replay.entries.values()
    assert entry.state == "ready" and entry.forward.aten > 0 and entry.backward.aten > 0


def test_replay_enters_no_module():
    block = _block()
    for seed in range(3):
        _step(block, seed, True)
    entered = []
    block.mlp.forward = lambda *a: entered.append(a)       # a replay never calls it
    before = rl.replay_counts()["replay"]
    _step(block, 7, True)
    assert rl.replay_counts()["replay"] == before + 1 and not entered


def test_gradients_accumulate_as_the_modular_code_does():
    block, ref = _block(), _block()
    for seed in range(3):
        _step(block, seed, True)
    for b, replay in ((block, True), (ref, False)):
        b.zero_grad(set_to_none=True)
        for seed in (10, 11):                      # two micro-batches into the same .grad
            _step(b, seed, replay, zero=False)
    _assert_same([p.grad for p in block.parameters()], [p.grad for p in ref.parameters()])
    assert_bits_differ(block.mlp.down_proj.weight.grad, _step(ref, 10, False)[-1], "one micro-batch's gradient")


def test_a_program_missing_a_step_is_caught_by_its_check():
    """Control: the modular code writes a new buffer through ``copy_``; the program with that step
    removed leaves the buffer as its check's poison left it (NaN), so the check must refuse."""

    class Copying(Block):
        def modular(self, x, scale):
            out = torch.empty_like(x)
            out.copy_(self.mlp(self.norm(x)))
            return x + out * scale

    block, ref = Copying(), Copying()
    ref.load_state_dict(block.state_dict())
    for seed in range(2):                               # first sight, record
        _assert_same(_step(block, seed, True), _step(ref, seed, False))
    (entry,) = block.replay.entries.values()
    assert entry.state == "check"
    copies = [s for s in entry.forward.steps if s.name == "aten::copy_"]
    assert copies and entry.forward.steps[-3] is copies[-1]   # the block's own copy, before its mul and add
    entry.forward.steps.remove(copies[-1])
    with pytest.warns(RuntimeWarning, match="forward output differed"):
        _assert_same(_step(block, 2, True), _step(ref, 2, False))
    assert entry.state == "refused"
    before = rl.replay_counts()
    _assert_same(_step(block, 3, True), _step(ref, 3, False))
    assert rl.replay_counts()["replay"] == before["replay"]


def test_the_decoder_layer_on_the_cpu_is_refused_with_its_reason():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (model, ref, model, ref, model, ref):
            rl.REPLAY[0] = m is model
            m.zero_grad(set_to_none=True)
            m.loss(tokens, tokens.roll(-1, 1)).sum().backward()
    assert any("reads device values on the host" in str(w.message) for w in caught)
    entry = next(iter(model.layers[0].replay.entries.values()))
    assert entry.state == "refused" and "aten::" in entry.reason
    _assert_same([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])


def test_a_recording_refuses_a_host_read():
    x = torch.randn(4)
    rec = Recording([x])
    with rec:
        if (x * 2).sum().item() > 0:
            pass
    with pytest.raises(ReplayRefused, match="reads device values on the host"):
        rec.program()


class _Watch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("how", ["no_grad_input", "hook", "dispatch_mode", "off", "autocast", "checkpoint",
                                 "subclass"])
def test_watched_or_untrained_calls_run_the_modular_code(how):
    block = _block()
    for seed in range(3):
        _step(block, seed, True)
    before = rl.replay_counts()
    x, scale, g = _inputs(5)
    if how == "no_grad_input":
        x = x.detach()
        block(x, scale)
    elif how == "hook":
        seen = []
        block.mlp.register_forward_hook(lambda *a: seen.append(1))
        block(x, scale).backward(g)
        assert seen == [1]
    elif how == "dispatch_mode":
        with _Watch():
            block(x, scale).backward(g)
    elif how == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            block(x, scale).backward(g)
    elif how == "checkpoint":
        torch.utils.checkpoint.checkpoint(block, x, scale, use_reentrant=False).backward(g)
    elif how == "subclass":
        _Sub = type("_Sub", (torch.Tensor,), {})
        block(x.detach().as_subclass(_Sub).requires_grad_(), scale).backward(g)
    else:
        rl.REPLAY[0] = False
        block(x, scale).backward(g)
    assert rl.replay_counts() == before


def test_a_copy_of_the_module_starts_without_programs():
    block = _block()
    for seed in range(3):
        _step(block, seed, True)
    twin = copy.deepcopy(block)
    assert twin.replay is not block.replay and not twin.replay.entries
    _assert_same(_step(twin, 4, True), _step(block, 4, False))
    saved = io.BytesIO()
    torch.save(block, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert not loaded.replay.entries
    _assert_same(_step(loaded, 5, True), _step(block, 5, False))


def test_a_shape_seen_once_is_not_recorded():
    block = _block()
    before = rl.replay_counts()
    for tokens in (3, 4, 5, 6):                         # a new sequence length every call
        x = torch.randn(2, tokens, ARGS.hidden_size).to(ARGS.dtype).requires_grad_()
        block(x, torch.ones(ARGS.hidden_size, dtype=ARGS.dtype)).sum().backward()
    assert rl.replay_counts() == before and len(block.replay.entries) == 4


@pytest.mark.parametrize("calls", [1, 2, 3])            # the record call, the check call, a replay
def test_a_second_backward_with_retain_graph(calls):
    block, ref = _block(), _block()
    for seed in range(calls):
        _step(block, seed, True)
    for b, replay in ((block, True), (ref, False)):
        rl.REPLAY[0] = replay
        b.zero_grad(set_to_none=True)
        x, scale, g = _inputs(9)
        y = b(x, scale)
        y.backward(g, retain_graph=True)
        y.backward(g)                                     # into the same .grad: twice the gradient
        if replay and calls == 3:                          # a replay saves for backward as any node does
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                y.backward(g)
    _assert_same([p.grad for p in block.parameters()], [p.grad for p in ref.parameters()])


def test_a_record_call_whose_graph_is_dropped_is_recorded_again():
    block = _block()
    _step(block, 0, True)                                # first sight
    x, scale, _ = _inputs(1)
    block(x, scale)                                      # the record call; its graph dropped unused
    (entry,) = block.replay.entries.values()
    import gc
    gc.collect()
    assert entry.state == "recording" and entry.recording() is None
    before = rl.replay_counts()
    for seed in (2, 3, 4):                               # record again, check, replay
        _step(block, seed, True)
    assert {k: rl.replay_counts()[k] - before[k] for k in before} == {"record": 1, "check": 1, "replay": 1,
                                                                      "refused": 0}


def test_a_call_inside_torch_checkpoint_is_seen_without_the_hook_stack():
    """torch before 2.8 has no hook-stack query: a frame of ``torch.utils.checkpoint`` below the
    call (its forward, and its recomputation in the backward) is what marks it."""
    seen = []

    def fn(x):
        seen.append(rl._inside_checkpoint())
        return x.exp()                                   # saves its result: the backward recomputes

    x = torch.ones(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert seen == [True, True] and not rl._inside_checkpoint()      # forward, recomputation; control
