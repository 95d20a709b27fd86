"""Triton SiLU-and-mul and RoPE kernels under the Triton interpreter (CPU, fp16 and fp32).

Invariance is asserted bitwise (``assert_same_bits``: shape, dtype and raw bytes): an element's result is the same alone,
in a slice, in a strided view, after padding and under any block configuration.  Beside
each invariance check a negative control shows the vanilla torch formula (``F.silu(g) * u``
and the HF rotation, both in the 16-bit dtype) gives other bits on the same inputs.  Parity
with the CPU kernels: RoPE has no transcendental function, so it is the CPU bits exactly;
SiLU may differ by the last bit of ``exp`` (fp32 rtol = atol = 1e-6, fp16 one ulp: 1e-3).

The checks run in one child process with the interpreter on (:mod:`triton_interp`).
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from triton_interp import checks_of, interpreted_test, main

if __name__ == "__main__":  # the subprocess: interpret before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DTYPES = (torch.float32, torch.float16)
#: CPU parity of silu_mul: an ulp of exp, amplified where the backward's ``1 + g*(1 - sig)`` cancels.
SILU_TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-5)}


def rand(*shape, dtype=torch.float32, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _te():
    from tpinv.kernels import triton_elementwise
    return triton_elementwise


def _silu_fns():
    te = _te()
    return {"fwd": lambda g, u, cfg=None: te._launch_silu_fwd(g, u, cfg),
            "bwd": lambda g, u, cfg=None: torch.stack(te._launch_silu_bwd(_grad_of(g, u), g, u, cfg), -1)}


def _grad_of(g, u):
    """An upstream gradient that is an elementwise function of (g, u) (exact, position free)."""
    return torch.sub(torch.mul(g, 0.25), u)


# ------------------------------------------------------------------ checks (run in the subprocess)

def check_silu_cpu_parity():
    from tpinv.kernels import reference_activation
    te = _te()
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-4, 20.0, -20.0, 88.0, -88.0, 90.0, -104.0,
                            200.0, -200.0, float("inf"), float("-inf"), float("nan")])
    for dtype in DTYPES:
        g = torch.cat([rand(9, 50, dtype=dtype, seed=1).reshape(-1), special.to(dtype)])
        u = torch.cat([rand(9, 50, dtype=dtype, seed=2).reshape(-1), torch.linspace(-2, 2, 16).to(dtype)])
        dy = rand(g.numel(), dtype=dtype, seed=3)
        torch.testing.assert_close(te.silu_mul_forward_cuda(g, u), reference_activation.silu_mul_forward(g, u),
                                   equal_nan=True, **SILU_TOL[dtype])
        for ours, ref in zip(te.silu_mul_backward_cuda(dy, g, u), reference_activation.silu_mul_backward(dy, g, u)):
            torch.testing.assert_close(ours, ref, equal_nan=True, **SILU_TOL[dtype])
        # fp32 grad with 16-bit activations, as autograd may hand it
        for ours, ref in zip(te.silu_mul_backward_cuda(dy.float(), g, u),
                             reference_activation.silu_mul_backward(dy.float(), g, u)):
            torch.testing.assert_close(ours, ref, equal_nan=True, **SILU_TOL[dtype])


def check_silu_position_invariant():
    for dtype in DTYPES:
        g, u = rand(13, 77, dtype=dtype, seed=4), rand(13, 77, dtype=dtype, seed=5)
        for name, fn in _silu_fns().items():
            full = fn(g, u)
            for lo, hi in ((0, 1), (6, 7), (12, 13), (3, 8)):
                assert_same_bits(fn(g[lo:hi], u[lo:hi]), full[lo:hi], f"{name} rows {lo}:{hi}")
            assert_same_bits(fn(g[5, 3:4], u[5, 3:4]), full[5, 3:4], f"{name} one element")
            junk_g, junk_u = rand(4, 77, dtype=dtype, seed=6), rand(4, 77, dtype=dtype, seed=7)
            padded = fn(torch.cat([g, junk_g]), torch.cat([u, junk_u]))
            assert_same_bits(padded[:13], full, f"{name} padding rows")
            for cfg in ((16, 1), (64, 2), (1024, 4), (4096, 8)):
                assert_same_bits(fn(g, u, cfg), full, f"{name} config {cfg}")
            # strided views: the halves of a fused gate_up tensor, a column slice, a transpose
            fused = torch.cat([g, u], -1)
            assert_same_bits(fn(*fused.chunk(2, -1)), full, f"{name} gate_up halves")
            assert_same_bits(fn(g.t(), u.t()), fn(g.t().contiguous(), u.t().contiguous()), 'fn(g.t(), u.t())')
            wide_g, wide_u = torch.cat([g, g], -1), torch.cat([u, u], -1)
            assert_same_bits(fn(wide_g[:, ::2], wide_u[:, ::2]), fn(wide_g[:, ::2].contiguous(),
                                                                   wide_u[:, ::2].contiguous()), 'fn(wide_g[:, ::2], wide_u[:, ::2])')


def check_silu_vanilla_differs_control():
    te = _te()
    g, u = rand(13, 77, dtype=torch.float16, seed=4), rand(13, 77, dtype=torch.float16, seed=5)
    assert_bits_differ(F.silu(g) * u, te.silu_mul_forward_cuda(g, u), 'F.silu(g) * u')


def _rope_inputs(dtype, batch=2, heads=5, seq=11, dim=16, seed=0):
    from tpinv.kernels.reference_rope import rope_cos_sin
    pos = (torch.arange(seq) + 3).expand(batch, seq).contiguous()
    pos[1] += 40
    cos, sin = rope_cos_sin(pos, dim, 1e4)
    return rand(batch, heads, seq, dim, dtype=dtype, seed=seed), cos, sin


def _rope_fns():
    te = _te()
    return {"fwd": lambda x, c, s, cfg=None: te._launch_rope(x, c, s, 1, cfg),
            "bwd": lambda x, c, s, cfg=None: te._launch_rope(x, c, s, -1, cfg)}


def check_rope_cpu_bits():
    from tpinv.kernels import reference_rope
    te = _te()
    for dtype in DTYPES:
        for dim in (2, 6, 16, 64):
            x, cos, sin = _rope_inputs(dtype, dim=dim, seed=dim)
            for c, s in ((cos, sin), (cos[1], sin[1])):
                assert_same_bits(te.apply_rope_forward_cuda(x, c, s), reference_rope.apply_rope_forward(x, c, s),
                                 'te.apply_rope_forward_cuda(x, c, s)')
                assert_same_bits(te.apply_rope_backward_cuda(x, c, s), reference_rope.apply_rope_backward(x, c, s),
                                 'te.apply_rope_backward_cuda(x, c, s)')


def check_rope_position_invariant():
    configs = ((1, 1, 1, 1), (2, 2, 2, 1), (4, 8, 8, 4), (2, 4, 4, 2))
    for dtype in DTYPES:
        x, cos, sin = _rope_inputs(dtype)
        for name, fn in _rope_fns().items():
            full = fn(x, cos, sin)
            for i in (0, 5, 10):      # one position alone (a decode step)
                step = fn(x[:, :, i:i + 1], cos[:, i:i + 1], sin[:, i:i + 1])
                assert_same_bits(step, full[:, :, i:i + 1], f"{name} position {i}")
            assert_same_bits(fn(x[1:], cos[1:], sin[1:]), full[1:], f"{name} batch row")
            for lo, hi in ((0, 1), (1, 3), (3, 5)):   # a head shard (a TP rank's heads)
                assert_same_bits(fn(x[:, lo:hi], cos, sin), full[:, lo:hi], f"{name} heads {lo}:{hi}")
            for cfg in configs:
                assert_same_bits(fn(x, cos, sin, cfg), full, f"{name} config {cfg}")
            # [B, S, H, D] projections viewed as [B, H, S, D]; padded positions after the real ones
            bshd = x.transpose(1, 2).contiguous().transpose(1, 2)
            assert_same_bits(fn(bshd, cos, sin), full, f"{name} transposed view")
            xp = torch.cat([x, rand(2, 5, 4, 16, dtype=dtype, seed=9)], 2)
            cp, sp = torch.cat([cos, cos[:, :4]], 1), torch.cat([sin, sin[:, :4]], 1)
            assert_same_bits(fn(xp, cp, sp)[:, :, :11], full, f"{name} padding positions")
            # one table for every batch row: 2-D, or expanded with stride 0
            x1 = x[1:].expand(3, -1, -1, -1)
            out2d = fn(x1, cos[1], sin[1])
            assert_same_bits(fn(x1, cos[1].expand(3, -1, -1), sin[1].expand(3, -1, -1)), out2d,
                             'fn(x1, cos[1].expand(3, -1, -1), sin[1].expand(...')
            assert_same_bits(out2d[2:], full[1:], f"{name} 2-D table")


def check_rope_vanilla_differs_control():
    te = _te()
    x, cos, sin = _rope_inputs(torch.float16, heads=8, seq=64, dim=64, seed=3)
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    vanilla = x * c + torch.cat((-x[..., 32:], x[..., :32]), -1) * s
    assert_bits_differ(vanilla, te.apply_rope_forward_cuda(x, cos, sin), 'vanilla')


def check_empty_and_errors():
    from tpinv.core.contract import InvarianceError
    te = _te()
    g = torch.empty(0, 5)
    assert te.silu_mul_forward_cuda(g, g).shape == (0, 5)
    assert [t.shape for t in te.silu_mul_backward_cuda(g, g, g)] == [(0, 5), (0, 5)]
    x, cos, sin = _rope_inputs(torch.float32, seq=0)
    assert te.apply_rope_forward_cuda(x, cos, sin).shape == x.shape
    assert te.apply_rope_backward_cuda(x, cos, sin).shape == x.shape
    a = rand(3, 4)
    expect = [(InvarianceError, lambda: te.silu_mul_forward_cuda(a, a[:, :2])),
              (TypeError, lambda: te.silu_mul_forward_cuda(a, a.half())),
              (InvarianceError, lambda: te.silu_mul_forward_cuda(a.double(), a.double())),
              (InvarianceError, lambda: te.silu_mul_backward_cuda(a[:1], a, a)),
              (InvarianceError, lambda: te.apply_rope_forward_cuda(rand(2, 3, 4), cos, sin)),
              (TypeError, lambda: te.apply_rope_forward_cuda(rand(1, 1, 4, 8), rand(4, 8).half(), rand(4, 8))),
              (InvarianceError, lambda: te.apply_rope_backward_cuda(rand(1, 1, 4, 8), rand(5, 8), rand(5, 8)))]
    for error, call in expect:
        try:
            call()
        except error:
            continue
        raise AssertionError(f"expected {error.__name__}")
    os.environ["TRITON_INTERPRET"] = "0"      # a real launch refuses CPU tensors with a clear error
    try:
        te.silu_mul_forward_cuda(a, a)
    except ValueError as e:
        assert "CUDA" in str(e)
    else:
        raise AssertionError("CPU tensors outside the interpreter were accepted")
    finally:
        os.environ["TRITON_INTERPRET"] = "1"


CHECKS = checks_of(dict(globals()))
test_interpreted_kernel = interpreted_test(__file__, CHECKS)

if __name__ == "__main__":
    main(CHECKS)
