"""Triton SiLU-and-mul and RoPE on CUDA: a row's bits ignore its batch, padding, view and head shard.

Invariance is asserted bitwise; beside each check a negative control shows the vanilla
path (``F.silu(g) * up`` in bf16, the HF rotation computed in bf16) gives other bits on the
same inputs.  Parity with the CPU kernels on the same values, and with the same torch code
run on CUDA (the ops' current CUDA slot), is ``allclose``: RoPE fp32 1e-6 (no transcendental,
only the rounding of the products differs if at all), SiLU fp32 1e-5 (``exp`` implementations
differ), bf16 2e-2 (one rounding).  Skips without CUDA.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpinv.kernels import reference_activation, reference_rope
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda"
DTYPES = (torch.bfloat16, torch.float32)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
ROPE_TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2e-2, 2e-2)}
T, I = 4096, 3072                 # tokens x intermediate (per TP shard) for silu_mul
B, H, S, D = 2, 32, 512, 128      # rope


def te():
    from tpinv.kernels import triton_elementwise
    return triton_elementwise


def rand(*shape, dtype=torch.float32, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEV)


def silu_fns():
    k = te()
    return {"fwd": lambda g, u: k.silu_mul_forward_cuda(g, u),
            "bwd": lambda g, u: torch.stack(k.silu_mul_backward_cuda(torch.sub(torch.mul(g, 0.25), u), g, u), -1)}


def rope_fns():
    k = te()
    return {"fwd": k.apply_rope_forward_cuda, "bwd": k.apply_rope_backward_cuda}


def rope_inputs(dtype, batch=None, heads=None, seq=None, seed=0):
    batch, heads, seq = batch or B, heads or H, S if seq is None else seq
    pos = torch.arange(seq, device=DEV).expand(batch, seq).contiguous()
    pos[1:] += 1000
    cos, sin = reference_rope.rope_cos_sin(pos, D, 1e6)
    return rand(batch, heads, seq, D, dtype=dtype, seed=seed, scale=1.0), cos, sin


# ------------------------------------------------------------------ silu_mul

@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_rows_alone_equal_rows_in_batch(dtype, direction):
    fn = silu_fns()[direction]
    g, u = rand(T, I, dtype=dtype, seed=1), rand(T, I, dtype=dtype, seed=2)
    full = fn(g, u)
    for lo, n in ((0, 1), (T // 2, 1), (T - 1, 1), (5, 3), (100, 64), (1000, 1000)):
        assert_same_bits(fn(g[lo:lo + n], u[lo:lo + n]), full[lo:lo + n], f"rows {lo}:{lo + n}")
    pad_g, pad_u = rand(7, I, dtype=dtype, seed=3), rand(7, I, dtype=dtype, seed=4)
    assert_same_bits(fn(torch.cat([g, pad_g]), torch.cat([u, pad_u]))[:T], full, "padding rows")
    # the halves of a fused [T, 2I] gate_up projection are strided views
    assert_same_bits(fn(*torch.cat([g, u], -1).chunk(2, -1)), full, "gate_up halves")
    assert_same_bits(fn(g[:, :1000], u[:, :1000]), full[:, :1000], "column slice")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_config_does_not_move_bits(dtype):
    k = te()
    g, u = rand(1000, 1000, dtype=dtype, seed=5), rand(1000, 1000, dtype=dtype, seed=6)
    dy = rand(1000, 1000, dtype=dtype, seed=7)
    ref, ref_b = k._launch_silu_fwd(g, u), k._launch_silu_bwd(dy, g, u)
    for cfg in ((1024, 4), (2048, 4), (4096, 8), (256, 1)):
        assert_same_bits(k._launch_silu_fwd(g, u, cfg), ref, f"config {cfg}")
        for a, b in zip(k._launch_silu_bwd(dy, g, u, cfg), ref_b):
            assert_same_bits(a, b, f"bwd {cfg}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_parity_with_cpu_and_torch_path(dtype):
    k = te()
    g, u = rand(257, I, dtype=dtype, seed=8), rand(257, I, dtype=dtype, seed=9)
    dy = rand(257, I, dtype=dtype, seed=10, scale=1.0)
    special = torch.tensor([0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0,
                            float("inf"), float("-inf")], device=DEV).to(dtype)
    g[0, :special.numel()] = special
    rtol, atol = TOL[dtype]
    ours = (k.silu_mul_forward_cuda(g, u),) + k.silu_mul_backward_cuda(dy, g, u)
    for ref_args, name in (((g.cpu(), u.cpu(), dy.cpu()), "cpu"), ((g, u, dy), "torch on cuda")):
        ref = (reference_activation.silu_mul_forward(*ref_args[:2]),) + \
            reference_activation.silu_mul_backward(ref_args[2], *ref_args[:2])
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.cpu().float(), b.cpu().float(), rtol=rtol, atol=atol,
                                       equal_nan=True, msg=lambda m: f"{name}: {m}")


def test_silu_vanilla_differs_control():
    """``F.silu(g) * up`` rounds twice in bf16: the bitwise checks above would see it."""
    g, u = rand(T, I, dtype=torch.bfloat16, seed=1), rand(T, I, dtype=torch.bfloat16, seed=2)
    assert_bits_differ(F.silu(g) * u, te().silu_mul_forward_cuda(g, u), 'F.silu(g) * u')


def test_silu_mul_empty_and_dtype_errors():
    k = te()
    e = torch.empty(0, I, device=DEV, dtype=torch.bfloat16)
    assert k.silu_mul_forward_cuda(e, e).shape == e.shape
    assert all(t.shape == e.shape for t in k.silu_mul_backward_cuda(e, e, e))
    with pytest.raises(TypeError, match="dtype"):
        k.silu_mul_forward_cuda(e, e.float())
    with pytest.raises(ValueError, match="device"):
        k.silu_mul_forward_cuda(e, e.cpu())


# ------------------------------------------------------------------ rope

@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_position_alone_equals_prefill(dtype, direction):
    fn = rope_fns()[direction]
    x, cos, sin = rope_inputs(dtype, seed=1)
    full = fn(x, cos, sin)
    for i in (0, 1, S // 2, S - 1):        # one position alone: a decode step
        step = fn(x[:, :, i:i + 1], cos[:, i:i + 1], sin[:, i:i + 1])
        assert_same_bits(step, full[:, :, i:i + 1], f"position {i}")
    assert_same_bits(fn(x[1:], cos[1:], sin[1:]), full[1:], "batch row alone")
    for c in (2, 4, 8):                    # a TP rank's heads
        for r in (0, c - 1):
            sl = slice(r * H // c, (r + 1) * H // c)
            assert_same_bits(fn(x[:, sl], cos, sin), full[:, sl], f"heads of rank {r}/{c}")
    pad = min(77, S)
    xp = torch.cat([x, rand(B, H, pad, D, dtype=dtype, seed=2, scale=1.0)], 2)
    cp, sp = torch.cat([cos, cos[:, :pad]], 1), torch.cat([sin, sin[:, :pad]], 1)
    assert_same_bits(fn(xp, cp, sp)[:, :, :S], full, "padding positions")
    bshd = x.transpose(1, 2).contiguous().transpose(1, 2)   # [B, S, H, D] projections viewed
    assert_same_bits(fn(bshd, cos, sin), full, "transposed view")
    one = fn(x[1:], cos[1], sin[1])                           # a 2-D table
    assert_same_bits(one, full[1:], "2-D table")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_config_does_not_move_bits(dtype):
    k = te()
    x, cos, sin = rope_inputs(dtype, heads=12, seq=100, seed=3)
    for sign in (1, -1):
        ref = k._launch_rope(x, cos, sin, sign)
        for cfg in ((1, 1, 64, 1), (2, 16, 32, 4), (8, 4, 64, 8), (4, 8, 16, 2)):
            assert_same_bits(k._launch_rope(x, cos, sin, sign, cfg), ref, f"config {cfg}, sign {sign}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_parity_with_cpu_and_torch_path(dtype):
    k = te()
    x, cos, sin = rope_inputs(dtype, heads=8, seq=300, seed=4)
    rtol, atol = ROPE_TOL[dtype]
    for ours_fn, ref_fn in ((k.apply_rope_forward_cuda, reference_rope.apply_rope_forward),
                            (k.apply_rope_backward_cuda, reference_rope.apply_rope_backward)):
        ours = ours_fn(x, cos, sin)
        for args, name in (((x.cpu(), cos.cpu(), sin.cpu()), "cpu"), ((x, cos, sin), "torch on cuda")):
            torch.testing.assert_close(ours.cpu().float(), ref_fn(*args).cpu().float(), rtol=rtol, atol=atol,
                                       msg=lambda m: f"{ref_fn.__name__} vs {name}: {m}")


def test_rope_vanilla_differs_control():
    """The HF rotation computed in bf16 (tables cast to bf16) rounds differently."""
    x, cos, sin = rope_inputs(torch.bfloat16, seed=5)
    ours = te().apply_rope_forward_cuda(x, cos, sin)
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    vanilla = x * c + torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1) * s
    assert_bits_differ(vanilla, ours, 'vanilla')


def test_rope_empty_and_errors():
    k = te()
    x, cos, sin = rope_inputs(torch.bfloat16, seq=0)
    assert k.apply_rope_forward_cuda(x, cos, sin).shape == x.shape
    from tpinv.core.contract import InvarianceError
    x, cos, sin = rope_inputs(torch.bfloat16, seq=16)
    with pytest.raises(InvarianceError):
        k.apply_rope_forward_cuda(x, cos[:, :8], sin[:, :8])
    with pytest.raises(TypeError, match="fp32"):
        k.apply_rope_backward_cuda(x, cos.half(), sin)
