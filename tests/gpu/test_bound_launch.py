"""Bound Triton launches (tpinv.kernels.launch) and direct eager op calls give the bits of Triton's
own launch through the dispatcher, and really run.

Each case runs twice with binding on (the second launch of a specialization goes through the bound
launcher: the counter moves; on Triton 3.6 it calls the launcher's C entry directly, descriptors
expanded once), once with direct launches off and once with binding and direct eager calls off; all
give the same bytes.  Control: the matmul with another leaf count differs.  A bound matmul keeps its TMA
descriptors per address: a new tensor at a freed tensor's address gets a fresh launch's bytes
(control: the old tensor's product differs), and their expansions are kept per kernel parameter.
Attention's forward and backward launches keep theirs the same way (control: the old values'
outputs and gradients differ).
"""
from __future__ import annotations

import pytest
import torch
import triton

from tpinv import ops
from tpinv.kernels import descriptors
from tpinv.kernels import launch as launch_mod
from tpinv.ops import registry
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cases(dtype, leaves):
    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen).to("cuda", dtype)  # noqa: E731
    x16, x512, w, wt = r(16, 1024), r(512, 1024), r(768, 1024), r(1024, 768).t()
    g, u, nw = r(64, 3072), r(64, 3072), r(1024) + 1
    q, k, v = r(2, 8, 100, 64), r(2, 4, 100, 64), r(2, 4, 100, 64)
    pos = torch.arange(100, device="cuda")[None].expand(2, 100)
    return lambda: [ops.matmul(x16, w, leaves, 1), ops.matmul(x512, w, leaves, 1), ops.matmul(x16, wt, leaves, 1),
                    ops.matmul_partial(x512, w, leaves), ops.silu_mul(g, u), ops.rms_norm(x512, nw, 1e-6),
                    ops.attention(q, k, v, pos), ops.log_softmax(g.float(), 4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bound_launches_give_triton_launch_bits(dtype):
    run = _cases(dtype, 8)
    first = run()
    before, direct = launch_mod.bound_launches(), launch_mod.direct_launches()
    second = run()
    assert launch_mod.bound_launches() > before, "no launch went through a bound launcher"
    if launch_mod.direct_available():
        assert launch_mod.direct_launches() > direct, "no bound launch called the launcher directly"
    launch_mod.DIRECT[0] = False
    try:
        wrapped = run()
    finally:
        launch_mod.DIRECT[0] = True
    launch_mod.BIND[0], registry.EAGER_CALLS[0] = False, False
    try:
        plain = run()
    finally:
        launch_mod.BIND[0], registry.EAGER_CALLS[0] = True, True
    for i, (a, b, c, d) in enumerate(zip(first, second, plain, wrapped)):
        assert_same_bits(a, c, f"case {i}: first launch vs Triton's launch")
        assert_same_bits(b, c, f"case {i}: bound launch vs Triton's launch")
        assert_same_bits(d, c, f"case {i}: bound launch through Triton's wrapper vs Triton's launch")
    assert_bits_differ(_cases(dtype, 2)()[1], second[1], "control: 2 leaves vs 8")


def test_direct_launches_available_on_triton_3_6():
    """The launcher form direct launches read is Triton 3.6's: there they must be on."""
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"Triton {triton.__version__}: direct launches are checked on 3.6")
    assert launch_mod.direct_available()


def test_training_step_grads_equal_without_binding():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 512, generator=gen).cuda().bfloat16().requires_grad_()
    w = torch.randn(1024, 512, generator=gen).cuda().bfloat16().requires_grad_()

    def step():
        x.grad = w.grad = None
        ops.matmul(x, w, 4, 4).float().square().sum().backward()
        return [x.grad.clone(), w.grad.clone()]

    step()
    bound = step()
    launch_mod.BIND[0], registry.EAGER_CALLS[0] = False, False
    try:
        plain = step()
    finally:
        launch_mod.BIND[0], registry.EAGER_CALLS[0] = True, True
    for a, b, what in zip(bound, plain, ("dx", "dw")):
        assert_same_bits(a, b, what)


@pytest.mark.parametrize("rows", [16, 512], ids=["triton-kernel", "gluon-kernel"])
def test_reused_descriptors_read_the_tensor_now_at_the_address(rows):
    """Once a matmul's launch is bound its TMA descriptors are kept per address: a new tensor at a
    freed tensor's address gets the bits of a fresh launch through Triton, not the old tensor's."""
    gen = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=gen).to("cuda", torch.bfloat16)  # noqa: E731
    w, wt = r(768, 1024), r(1024, 768).t()
    for weight in (w, wt):
        memory = r(rows * 1024)
        x = memory.view(rows, 1024)
        for _ in range(3):                       # through Triton, then bound (descriptors built), then reused
            old = ops.matmul(x, weight, 8, 1)
        address, before = x.data_ptr(), descriptors.descriptor_reuses()
        del x
        memory.copy_(r(rows * 1024))             # other values at the same address,
        x = memory.view(rows, 1024)              # in a new tensor
        assert x.data_ptr() == address
        direct = launch_mod.direct_launches()
        new = ops.matmul(x, weight, 8, 1)        # on Triton 3.6: the kept descriptors' kept expansions
        assert descriptors.descriptor_reuses() >= before + 2, "the kept descriptors were not used"
        if launch_mod.direct_available():
            assert launch_mod.direct_launches() > direct, "the launch did not call the launcher directly"
        launch_mod.BIND[0], registry.EAGER_CALLS[0] = False, False
        try:
            plain = ops.matmul(x, weight, 8, 1)
        finally:
            launch_mod.BIND[0], registry.EAGER_CALLS[0] = True, True
        assert_same_bits(new, plain, "reused descriptors vs a fresh launch through Triton")
        assert_bits_differ(new, old, "control: the old tensor's product")


@pytest.mark.parametrize("rows", [16, 512], ids=["triton-kernel", "gluon-kernel"])
def test_kept_descriptors_are_expanded_once(rows):
    """A kept descriptor's expansion for the launcher is kept per kernel parameter, also where one
    descriptor fills several parameters (the Gluon kernel's stand-ins for unused ones): repeated
    launches on the same addresses expand nothing.  Control: an input at a new address is expanded."""
    if not launch_mod.direct_available():
        pytest.skip("expansions are kept on the direct launch path (Triton 3.6)")
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(rows, 1024, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(768, 1024, generator=gen).to("cuda", torch.bfloat16)
    for _ in range(3):                  # through Triton, then bound (descriptors built), then kept
        y = ops.matmul(x, w, 8, 1)
        del y                           # the next output lands at the same address
    before = descriptors.descriptor_expansions()
    for _ in range(3):
        y = ops.matmul(x, w, 8, 1)
        del y
    assert descriptors.descriptor_expansions() == before, "kept descriptors were expanded again"
    moved = x.clone()
    ops.matmul(moved, w, 8, 1)
    assert descriptors.descriptor_expansions() > before, "control: a new address was not expanded"


def test_attention_keeps_descriptors_per_address():
    """Once attention's launches are bound (the forward; the backward's dK/dV and dQ kernels), their
    TMA descriptors are kept per address and, on Triton 3.6, expanded once: calls on the same
    addresses reuse all eight (k, v; q and grad_out rows twice; k, v) and expand none.  New values
    at those addresses give the bytes of launches through Triton with nothing kept.  Control: the
    old values' output and gradients differ."""
    gen = torch.Generator().manual_seed(17)
    B, HQ, HKV, S, D = 2, 8, 4, 300, 128
    shapes = [(B, S, HQ, D), (B, S, HKV, D), (B, S, HKV, D), (B, S, HQ, D)]
    memory = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    pos = torch.arange(S, device="cuda")[None].expand(B, S)

    def fill():
        for m in memory:
            m.copy_(torch.randn(m.shape, generator=gen))

    def step():                  # the model's layout: [B, S, H, D] buffers seen as [B, H, S, D]
        q, k, v = (m.transpose(1, 2).detach().requires_grad_() for m in memory[:3])
        out = ops.attention(q, k, v, pos)
        out.backward(memory[3].transpose(1, 2))
        return [out.detach(), q.grad, k.grad, v.grad]

    fill()
    for _ in range(3):           # through Triton, then bound (descriptors built), then kept
        old = step()
    fill()
    reuses, expansions = descriptors.descriptor_reuses(), descriptors.descriptor_expansions()
    new = step()
    assert descriptors.descriptor_reuses() - reuses >= 8, "attention's kept descriptors were not used"
    if launch_mod.direct_available():
        assert descriptors.descriptor_expansions() == expansions, "kept descriptors were expanded again"
    launch_mod.BIND[0], registry.EAGER_CALLS[0] = False, False
    try:
        plain = step()
    finally:
        launch_mod.BIND[0], registry.EAGER_CALLS[0] = True, True
    for what, a, b, c in zip(("out", "dq", "dk", "dv"), new, plain, old):
        assert_same_bits(a, b, f"{what}: kept descriptors vs launches through Triton")
        assert_bits_differ(a, c, f"control: {what} of the old values")


def test_launch_hooks_see_bound_launches():
    """A bound launch passes Triton's launch hooks only when one is registered (an empty hook chain
    is skipped with its launch metadata); a registered enter hook sees every bound launch, named.
    Control: with the hook removed it sees none."""
    from triton import knobs
    chain = knobs.runtime.launch_enter_hook
    if type(chain).__name__ != "HookChain":
        pytest.skip("this Triton keeps no launch hook chain")
    run = _cases(torch.bfloat16, 8)
    run()                                   # every specialization bound
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    chain.add(hook)
    try:
        before = launch_mod.bound_launches()
        run()
        torch.cuda.synchronize()
        launched = launch_mod.bound_launches() - before
    finally:
        chain.remove(hook)
    assert launched > 0 and len(seen) >= launched, f"{len(seen)} hook calls for {launched} bound launches"
    assert any("mm" in name for name in seen), seen
    count = len(seen)
    run()
    assert len(seen) == count, "the removed hook still ran"
