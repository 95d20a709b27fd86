"""Ops on tensors of a CUDA device that is not the current one run on that device, with the bits
they have on the current one.

Triton launches on the current device and its stream; torch's own ops take the device of their
inputs.  The ops' CUDA slots make the inputs' device current for the call
(:func:`tpinv.ops.registry.on_device_of_inputs`), so a model moved to ``cuda:1`` without
``torch.cuda.set_device(1)`` computes there (before, its kernels were launched on ``cuda:0``
with ``cuda:1`` addresses, out of order with ``cuda:1``'s stream).  Each case is run on ``cuda:1``
with ``cuda:0`` current, on inputs written behind a spin on ``cuda:1``'s stream, and compared byte for
byte with the same op on ``cuda:0``; the current device stays ``cuda:0``.  Control: the
matmul with another leaf count differs.
"""
from __future__ import annotations

import pytest
import torch

from tpinv import ops
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")


def _inputs(device):
    gen = torch.Generator().manual_seed(21)
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=gen).to(device, dt)  # noqa: E731
    return dict(x=r(272, 1024), w=r(640, 1024), xs=r(12, 1024), g=r(272, 640), u=r(272, 640),
                q=r(2, 8, 150, 64), k=r(2, 4, 150, 64), v=r(2, 4, 150, 64), nw=r(1024) + 1,
                pos=torch.arange(150)[None].expand(2, 150).contiguous().to(device),
                logits=r(12, 5000, dt=torch.float32), ids=torch.randint(0, 640, (40,), generator=gen).to(device))


def _run(t, leaves=8):
    x = t["x"].clone().requires_grad_(True)
    w = t["w"].clone().requires_grad_(True)
    y = ops.matmul(x, w, leaves, 8)
    y.backward(t["g"])
    return [y, x.grad, w.grad, ops.matmul(t["xs"], t["w"], leaves, 1), ops.rms_norm(t["x"], t["nw"], 1e-6),
            ops.silu_mul(t["g"], t["u"]), ops.attention(t["q"], t["k"], t["v"], t["pos"]),
            ops.log_softmax(t["logits"], 8), ops.embedding(t["ids"], t["w"])]


def test_ops_on_another_device_run_there_with_the_same_bits():
    """The ``cuda:1`` inputs are written on ``cuda:1``'s stream behind a 50 ms spin, so a kernel
    launched anywhere but on that stream would read the zeros they held before."""
    torch.cuda.set_device(0)
    want = _run(_inputs("cuda:0"))
    source = _inputs("cuda:1")
    held = {name: torch.zeros_like(t) for name, t in source.items()}
    torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        torch.cuda._sleep(100_000_000)             # about 50 ms of clock cycles on cuda:1's stream
    for name, t in held.items():
        t.copy_(source[name])                      # queued behind the spin, on cuda:1's stream
    got = _run(held)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    for g, w in zip(got, want):
        assert g.device == torch.device("cuda:1")
        assert_same_bits(g.cpu(), w.cpu())
    assert_bits_differ(_run(source, 4)[0].cpu(), want[0].cpu())   # control: other leaves
