"""Plain eager op calls run the kernel directly; they give the dispatcher path's bits.

:class:`tpinv.ops.registry.InvariantOp` skips the dispatcher for plain eager calls (forward, and
backward through the op's own autograd formula).  Checked here: outputs and gradients are the
bytes of the dispatched call for every differentiable op family; the direct path really ran (the
dispatcher entry replaced by one that raises is never reached), and it is left for the dispatcher
under a dispatch mode, under ``torch.compile``, with tensor subclasses and with a tensor on a
device other than the CPU or CUDA (``meta``).  Control: the same products with another leaf
count differ (the check sees bits).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpinv import ops
from tpinv.ops import registry
from tpinv.ops.linear import matmul_op
from tpinv.testing import assert_bits_differ, assert_same_bits


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(3, 5, 64), w=r(48, 64), nw=r(64) + 1, g=r(3, 48), u=r(3, 48),
                q=r(1, 4, 7, 16), k=r(1, 2, 7, 16), v=r(1, 2, 7, 16))


def _run_all(leaves=4):
    t = {k: v.clone().requires_grad_() for k, v in _inputs().items()}
    pos = torch.arange(7)[None]
    outs = [ops.matmul(t["x"], t["w"], leaves, 4), ops.rms_norm(t["x"], t["nw"], 1e-6),
            ops.silu_mul(t["g"], t["u"]), ops.attention(t["q"], t["k"], t["v"], pos),
            ops.log_softmax(t["g"], 4)]
    loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
    loss.backward()
    return outs + [t[k].grad for k in sorted(t)]


def test_direct_calls_equal_dispatched_calls_bits():
    direct = _run_all()
    registry.EAGER_CALLS[0] = False
    try:
        dispatched = _run_all()
    finally:
        registry.EAGER_CALLS[0] = True
    assert len(direct) == len(dispatched) == 13
    for i, (a, b) in enumerate(zip(direct, dispatched)):
        assert_same_bits(a, b, f"output/gradient {i}")
    assert_bits_differ(_run_all(leaves=2)[0], direct[0], "control: matmul with 2 leaves vs 4")


def _refusing_dispatcher(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("dispatcher reached")
    monkeypatch.setattr(matmul_op, "_opoverload", refuse)


def test_plain_eager_call_skips_the_dispatcher(monkeypatch):
    x, w = _inputs()["x"], _inputs()["w"]
    expected = ops.matmul(x, w, 4, 4)
    _refusing_dispatcher(monkeypatch)
    assert_same_bits(ops.matmul(x, w, 4, 4), expected, "direct call")
    xr = x.clone().requires_grad_()
    ops.matmul(xr, w, 4, 4).sum().backward()      # the eager autograd function, no dispatcher
    assert xr.grad is not None


class _Seen(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_observed_calls_go_through_the_dispatcher(monkeypatch):
    x, w = _inputs()["x"], _inputs()["w"]
    _refusing_dispatcher(monkeypatch)
    with pytest.raises(AssertionError, match="dispatcher reached"):
        with _Seen():
            ops.matmul(x, w, 4, 4)
    with pytest.raises(AssertionError, match="dispatcher reached"):
        matmul_op(x, w, 4, grad_leaves=4)           # keyword arguments: the dispatcher fills schemas

    class Sub(torch.Tensor):
        pass

    with pytest.raises(AssertionError, match="dispatcher reached"):
        ops.matmul(x.as_subclass(Sub), w, 4, 4)
    for a, b in ((x, w.to("meta")), (x.to("meta"), w), (x.to("meta"), w.to("meta"))):
        with pytest.raises(AssertionError, match="dispatcher reached"):   # a device other than CPU/CUDA
            ops.matmul(a, b, 4, 4)
