"""Autograd functions called without a gradient to record run their forward directly, same bits.

:func:`tpinv.core.autograd.apply_function` skips ``Function.apply`` when no autograd node can
be recorded (grad mode off, or no argument requiring a gradient).  Checked here: a model's
logits under ``no_grad`` and for a frozen model are the bytes of the recorded forward, and no
layer's ``Function.apply`` ran (each replaced by one that raises); with a gradient to record,
under a torch function or dispatch mode and under ``torch.compile`` ``apply`` runs.  Control: the same
forward with the final norm's weight doubled (exact) gives other bytes.
"""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tpinv.core.autograd import apply_function, direct_forwards
from tpinv.layers.embedding import _VocabParallelLookup
from tpinv.layers.functions import ColumnParallelMatmul, RowParallelTreeMatmul
from tpinv.layers.norm import _HeadRMSNorm
from tpinv.models import Transformer, get_config
from tpinv.testing import assert_bits_differ, assert_same_bits

LAYER_FUNCTIONS = (ColumnParallelMatmul, RowParallelTreeMatmul, _HeadRMSNorm, _VocabParallelLookup)


def _model_and_tokens():
    torch.manual_seed(0)
    model = Transformer(get_config("qwen3-tiny", dtype=torch.float32))
    tokens = torch.randint(0, model.args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    return model, tokens


def _refuse_apply(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("Function.apply ran with no gradient to record")
    for fn in LAYER_FUNCTIONS:
        monkeypatch.setattr(fn, "apply", refuse)


def _calls_per_forward(model) -> int:
    a = model.args   # embedding; per layer q/k/v (one group), o, gate/up (one group), down and the q/k norms
    return 1 + a.num_layers * 5 + 1   # with the rotary embedding (one group); the output layer


def test_no_grad_forward_runs_forward_directly_with_the_recorded_bits(monkeypatch):
    model, tokens = _model_and_tokens()
    recorded = model(tokens)
    assert recorded.grad_fn is not None            # parameters need gradients: apply recorded nodes
    _refuse_apply(monkeypatch)
    before = direct_forwards()
    with torch.no_grad():
        direct = model(tokens)
    assert direct_forwards() - before == _calls_per_forward(model)
    assert_same_bits(direct, recorded.detach(), "no_grad logits vs recorded logits")
    with torch.no_grad():                           # control: the final norm's weight doubled
        model.norm.weight.mul_(2.0)
        assert_bits_differ(model(tokens), recorded.detach(), "doubled final norm")


def test_frozen_model_with_grad_mode_on_runs_directly(monkeypatch):
    model, tokens = _model_and_tokens()
    with torch.no_grad():
        reference = model(tokens)
    model.requires_grad_(False)                     # a frozen reference policy scoring log-probs
    _refuse_apply(monkeypatch)
    assert torch.is_grad_enabled()
    out = model(tokens)
    assert out.grad_fn is None
    assert_same_bits(out, reference, "frozen model vs no_grad")


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, dy):
        return dy * 2


def test_apply_runs_where_a_node_or_an_observer_may_need_it():
    x = torch.ones(3, requires_grad=True)
    before = direct_forwards()
    y = apply_function(_Twice, x)                  # a gradient to record: a node
    assert y.grad_fn is not None and direct_forwards() == before
    y.sum().backward()
    assert_same_bits(x.grad, torch.full((3,), 2.0))

    class WatchFunctions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class WatchDispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for watch in (WatchFunctions, WatchDispatch):
        with torch.no_grad(), watch():
            apply_function(_Twice, torch.ones(3))
        assert direct_forwards() == before, watch  # a mode sees the Function's apply
    with torch.no_grad():
        out = apply_function(_Twice, torch.ones(3))
    assert direct_forwards() == before + 1
    assert_same_bits(out, torch.full((3,), 2.0))


def test_compiled_no_grad_forward_keeps_the_bits():
    pytest.importorskip("torch._dynamo")
    model, tokens = _model_and_tokens()
    with torch.no_grad():
        eager = model(tokens)
        compiled = torch.compile(model, backend="eager", fullgraph=True)(tokens)
    assert_same_bits(compiled, eager, "compiled (eager backend) vs eager, no_grad")
