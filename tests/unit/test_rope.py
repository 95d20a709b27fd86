"""tpinv.ops.rope: tables and rotation give a token the same bits at any position context.

Negative controls: Hugging Face's ``dynamic`` rope (its frequencies follow the longest
sequence in the batch), and a rotation kernel whose vector body contracts ``x*cos + r*sin``
into a fused multiply-add while its scalar tail does not (written out with
``tpinv.testing.body_tail``, so it differs on every CPU kernel set -- torch's own complex
product does this on AVX-512/AVX2 only), give different bits for the same token under the
same comparisons.
"""
from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tpinv.testing import assert_bits_differ, assert_same_bits, num_threads, same_bits
from tpinv.testing.hf import rope_config_kwargs, rope_init_function
from tpinv.testing.body_tail import body_tail_map
from tpinv.core.contract import InvarianceError
from tpinv.ops.registry import cuda_kernel, has_cuda_kernel
from tpinv.ops.rope import apply_rope, apply_rope_backward_op, apply_rope_op, rope_cos_sin, rope_inv_freq
from tpinv.testing import record_ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
THETA = 10000.0
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
SCALINGS = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0}, "llama3": LLAMA3}
# Parity as (rtol, atol): tables in fp32 against HF's fp32 tables; the rotation against HF's
# apply_rotary_pos_emb, which in 16 bits rounds cos/sin and each product, tpinv rounds once.
TABLE_TOL = (1e-6, 1e-6)
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 2e-2), torch.float16: (1e-3, 2e-3)}


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def hf_rotary(rope_parameters: dict, head_dim: int, max_positions: int = 131072) -> LlamaRotaryEmbedding:
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_positions, **hf_rope(rope_parameters))
    return LlamaRotaryEmbedding(config)


def hf_rope(rope_parameters: dict) -> dict:
    """HF config arguments for ``rope_parameters`` (transformers 5's form) under the installed version."""
    params = dict(rope_parameters)
    return rope_config_kwargs(params.pop("rope_theta"), params.pop("rope_type"), **params)


def _rotate_fused(x, c, s, r):
    """Body: ``x*c`` kept exact and added to the rounded ``r*s`` with one rounding (an FMA)."""
    return (x.double() * c.double() + (r * s).double()).float()


def _rotate_plain(x, c, s, r):
    return x * c + r * s


def body_tail_rope(x, positions):
    """The control: rotation by a kernel whose vector body fuses a multiply-add, tail does not."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], THETA)
    xf = x.float()
    c, s = cos.expand_as(xf), sin.expand_as(xf)
    r = torch.cat((-xf[..., xf.shape[-1] // 2:], xf[..., :xf.shape[-1] // 2]), -1)
    if xf.is_contiguous():
        c, s = c.contiguous(), s.contiguous()
    else:
        r = r.transpose(1, 2).contiguous().transpose(1, 2)
    return body_tail_map(_rotate_fused, _rotate_plain, xf, c, s, r)


def fwd_bwd(x, cos, sin, grad):
    x = x.detach().clone().requires_grad_(True)
    out = apply_rope(x, cos, sin)
    out.backward(grad)
    return out.detach(), x.grad


def same(a, b):
    return all(same_bits(x, y) for x, y in zip(a, b))


# --- tables: a position alone == inside a longer range ------------------------------------

@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("head_dim", [40, 64, 72])
def test_table_position_alone_equals_in_range(scaling, head_dim):
    cos, sin = rope_cos_sin(torch.arange(3000), head_dim, THETA, SCALINGS[scaling])
    for p in (0, 1, 17, 1023, 2999):
        c1, s1 = rope_cos_sin(torch.tensor([p]), head_dim, THETA, SCALINGS[scaling])
        assert_same_bits(c1[0], cos[p], 'c1[0]')
        assert_same_bits(s1[0], sin[p], 's1[0]')
    chunk = rope_cos_sin(torch.arange(1000, 1037), head_dim, THETA, SCALINGS[scaling])
    assert_same_bits(chunk[0], cos[1000:1037], 'chunk[0]')
    assert_same_bits(chunk[1], sin[1000:1037], 'chunk[1]')
    batched = rope_cos_sin(torch.tensor([[5, 6, 7], [2990, 2991, 2992]]), head_dim, THETA, SCALINGS[scaling])
    assert_same_bits(batched[0][1], cos[2990:2993], 'batched[0][1]')
    assert_same_bits(batched[1][0], sin[5:8], 'batched[1][0]')


def test_table_vanilla_differs():
    """HF's dynamic rope: a token's table depends on the longest sequence it is batched with."""
    short = hf_rotary({"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}, 64, max_positions=32)
    cos_alone, _ = short(torch.zeros(1), torch.arange(10)[None])
    longer = hf_rotary({"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}, 64, max_positions=32)
    cos_batched, _ = longer(torch.zeros(1), torch.stack([torch.arange(100), torch.arange(100)]))
    assert_bits_differ(cos_alone[0], cos_batched[0, :10], 'cos_alone[0]')
    ours_alone, _ = rope_cos_sin(torch.arange(10), 64, THETA)
    ours_batched, _ = rope_cos_sin(torch.stack([torch.arange(100), torch.arange(100)]), 64, THETA)
    assert_same_bits(ours_alone, ours_batched[0, :10], 'ours_alone')


@settings(max_examples=15, deadline=None)
@given(start=st.integers(0, 200000), length=st.integers(1, 50), offset=st.integers(0, 49),
       scaling=st.sampled_from(sorted(SCALINGS)))
def test_table_property(start, length, offset, scaling):
    p = start + offset % length
    cos, sin = rope_cos_sin(torch.arange(start, start + length), 64, THETA, SCALINGS[scaling])
    c1, s1 = rope_cos_sin(torch.tensor([p]), 64, THETA, SCALINGS[scaling])
    assert_same_bits(c1[0], cos[p - start], 'c1[0]')
    assert_same_bits(s1[0], sin[p - start], 's1[0]')


@pytest.mark.parametrize("scaling", SCALINGS)
def test_table_parity_with_hf(scaling):
    params = {"rope_type": scaling, "rope_theta": THETA, **(SCALINGS[scaling] or {})}
    hf = hf_rotary(params, 64)
    positions = torch.arange(0, 20000, 7)[None]
    hf_cos, hf_sin = hf(torch.zeros(1), positions)
    cos, sin = rope_cos_sin(positions, 64, THETA, SCALINGS[scaling])
    torch.testing.assert_close(rope_inv_freq(64, THETA, SCALINGS[scaling]), hf.inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(cos, hf_cos, rtol=TABLE_TOL[0], atol=TABLE_TOL[1])
    torch.testing.assert_close(sin, hf_sin, rtol=TABLE_TOL[0], atol=TABLE_TOL[1])


def test_llama3_parity_with_transformers_init_function():
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, max_position_embeddings=131072,
                         **hf_rope({**LLAMA3, "rope_theta": 500000.0}))
    hf_inv_freq, scale = rope_init_function("llama3")(config)
    assert scale == 1.0
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, LLAMA3), hf_inv_freq, rtol=1e-6, atol=0)


# --- rotation: token alone == in sequence, rows, padding -------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [40, 64])
def test_token_alone_equals_in_sequence(dtype, head_dim):
    x, grad = randn(2, 3, 37, head_dim, dtype=dtype, seed=1), randn(2, 3, 37, head_dim, dtype=dtype, seed=2)
    cos, sin = rope_cos_sin(torch.arange(37), head_dim, THETA, LLAMA3)
    full = fwd_bwd(x, cos, sin, grad)
    for p in (0, 5, 36):
        c, s = rope_cos_sin(torch.tensor([p]), head_dim, THETA, LLAMA3)
        alone = fwd_bwd(x[:, :, p:p + 1], c, s, grad[:, :, p:p + 1])
        assert same(alone, [t[:, :, p:p + 1] for t in full])
    c, s = rope_cos_sin(torch.arange(10, 21), head_dim, THETA, LLAMA3)
    chunk = fwd_bwd(x[:, :, 10:21], c, s, grad[:, :, 10:21])
    assert same(chunk, [t[:, :, 10:21] for t in full])


def test_token_alone_vanilla_differs():
    x = randn(2, 3, 37, 40, seed=1)
    full = body_tail_rope(x, torch.arange(37))
    alone = torch.cat([body_tail_rope(x[:, :, p:p + 1].contiguous(), torch.tensor([p])) for p in range(37)], 2)
    assert_bits_differ(full, alone, "control")
    cos, sin = rope_cos_sin(torch.arange(37), 40, THETA)
    ours = torch.cat([apply_rope(x[:, :, p:p + 1], cos[p:p + 1], sin[p:p + 1]) for p in range(37)], 2)
    assert_same_bits(apply_rope(x, cos, sin), ours, 'apply_rope(x, cos, sin)')


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_row_alone_equals_row_in_padded_batch(dtype, batch):
    """Rows of different lengths, right-padded to the longest, with per-row [B, S, D] tables."""
    lengths = [5 + 7 * i for i in range(batch)]
    longest = max(lengths)
    x, grad = randn(batch, 3, longest, 72, dtype=dtype, seed=batch), randn(batch, 3, longest, 72, dtype=dtype)
    positions = torch.arange(longest).expand(batch, longest)
    cos, sin = rope_cos_sin(positions, 72, THETA, LLAMA3)
    full = fwd_bwd(x, cos, sin, grad)
    for i, n in enumerate(lengths):
        c, s = rope_cos_sin(torch.arange(n)[None], 72, THETA, LLAMA3)
        alone = fwd_bwd(x[i:i + 1, :, :n], c, s, grad[i:i + 1, :, :n])
        assert same(alone, [t[i:i + 1, :, :n] for t in full])


def test_row_alone_vanilla_differs():
    """HF dynamic rope + apply_rotary_pos_emb: a short row changes when batched with a long one."""
    x = randn(1, 3, 10, 64, seed=3)
    alone_rope = hf_rotary({"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}, 64, max_positions=32)
    cos, sin = alone_rope(x, torch.arange(10)[None])
    alone, _ = apply_rotary_pos_emb(x, x, cos, sin)
    batch_rope = hf_rotary({"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA}, 64, max_positions=32)
    padded = torch.cat([x, torch.zeros(1, 3, 90, 64)], 2).expand(2, 3, 100, 64)
    cos_b, sin_b = batch_rope(padded, torch.arange(100).expand(2, 100))
    batched, _ = apply_rotary_pos_emb(padded, padded, cos_b, sin_b)
    assert_bits_differ(alone, batched[:1, :, :10], 'alone')


# --- threads and strides -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_one_thread_equals_two_threads(dtype):
    x, grad = randn(1, 1, 2049, 40, dtype=dtype, seed=5), randn(1, 1, 2049, 40, dtype=dtype, seed=6)
    cos, sin = rope_cos_sin(torch.arange(2049), 40, THETA)
    with num_threads(1):
        one = fwd_bwd(x, cos, sin, grad)
    with num_threads(2):
        two = fwd_bwd(x, cos, sin, grad)
    assert same(one, two)


def test_threads_vanilla_differs():
    x = randn(1, 1, 2049, 40, seed=5)
    with num_threads(1):
        one = body_tail_rope(x, torch.arange(2049))
    with num_threads(2):
        two = body_tail_rope(x, torch.arange(2049))
    assert_bits_differ(one, two, "control")


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_equals_contiguous(dtype):
    """q as [B, S, H, D] transposed to [B, H, S, D] (a view), and a strided head dim."""
    x, grad = randn(2, 3, 37, 40, dtype=dtype, seed=7), randn(2, 3, 37, 40, dtype=dtype, seed=8)
    cos, sin = rope_cos_sin(torch.arange(37), 40, THETA)
    contiguous = fwd_bwd(x, cos, sin, grad)
    transposed = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert not transposed.is_contiguous()
    assert same(contiguous, fwd_bwd(transposed, cos, sin, grad))
    wide = torch.zeros(2, 3, 37, 80, dtype=dtype)
    wide[..., ::2] = x
    assert_same_bits(apply_rope(wide[..., ::2], cos, sin), contiguous[0], 'apply_rope(wide[..., ::2], cos, sin)')


def test_strided_vanilla_differs():
    x = randn(2, 3, 37, 40, seed=7)
    transposed = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert_bits_differ(body_tail_rope(x, torch.arange(37)), body_tail_rope(transposed, torch.arange(37)), "control")


# --- parity with HF's rotation --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_parity_with_hf(dtype):
    x, grad = randn(2, 4, 29, 64, dtype=dtype, seed=9), randn(2, 4, 29, 64, dtype=dtype, seed=10)
    positions = torch.arange(100, 129).expand(2, 29)
    cos, sin = rope_cos_sin(positions, 64, THETA, LLAMA3)
    ours = fwd_bwd(x, cos, sin, grad)
    ref, _ = apply_rotary_pos_emb(x, x, cos.to(dtype), sin.to(dtype))
    rtol, atol = TOL[dtype]
    assert ours[0].dtype == dtype
    torch.testing.assert_close(ours[0], ref, rtol=rtol, atol=atol)
    x32 = x.float().requires_grad_(True)  # backward against HF's fp32 gradient
    apply_rotary_pos_emb(x32, x32.detach(), cos, sin)[0].backward(grad.float())
    torch.testing.assert_close(ours[1], x32.grad.to(dtype), rtol=rtol, atol=atol)


# --- the op ran, registration, errors --------------------------------------------------------

def test_custom_ops_run_and_are_registered():
    x = randn(1, 2, 5, 8)
    cos, sin = rope_cos_sin(torch.arange(5), 8, THETA)
    with record_ops() as log:
        fwd_bwd(x, cos, sin, randn(1, 2, 5, 8, seed=1))
    assert "tpinv::apply_rope" in log and "tpinv::apply_rope_backward" in log
    torch.library.opcheck(torch.ops.tpinv.apply_rope.default, (x.requires_grad_(), cos, sin),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_bad_rope_settings():
    positions = torch.arange(4)
    for rope_type in ("dynamic", "yarn", "longrope"):
        with pytest.raises(NotImplementedError, match=rope_type):
            rope_cos_sin(positions, 64, THETA, {"rope_type": rope_type, "factor": 2.0})
    with pytest.raises(ValueError, match="high_freq_factor"):
        rope_cos_sin(positions, 64, THETA, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match="does not take"):
        rope_cos_sin(positions, 64, THETA, {"rope_type": "linear", "factor": 2.0, "beta_fast": 32})
    with pytest.raises(ValueError, match="rope_theta"):
        rope_cos_sin(positions, 64, THETA, {"rope_type": "default", "rope_theta": 500000.0})
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(positions, 63, THETA)
    with pytest.raises(TypeError, match="integer"):
        rope_cos_sin(positions.float(), 64, THETA)


def test_bad_apply_inputs():
    x = randn(2, 3, 5, 8)
    cos, sin = rope_cos_sin(torch.arange(5), 8, THETA)
    with pytest.raises(InvarianceError, match=r"\[S, D\] = \(5, 8\)"):
        apply_rope(x, cos[:4], sin[:4])
    with pytest.raises(InvarianceError, match=r"\[B, S, D\] = \(2, 5, 8\)"):
        apply_rope(x, cos.expand(3, 5, 8), sin.expand(3, 5, 8))
    with pytest.raises(TypeError, match="fp32"):
        apply_rope(x, cos.bfloat16(), sin.bfloat16())
    with pytest.raises(InvarianceError, match=r"\[B, H, S, D\]"):
        apply_rope(x[0], cos, sin)
    with pytest.raises(InvarianceError, match="dtype"):
        apply_rope(x.double(), cos, sin)
