"""Every ``tpinv::`` op on CUDA: a row's bits do not depend on its batch, padding or split.

The CUDA slots run the kernels each op's definition names (Triton kernels, or the ops'
fixed-order torch code; the matmul runs the Triton contract kernel).  Invariance is asserted bitwise; beside each
check a negative control shows torch's own CUDA path (``torch.sum``, a plain vocab-split
softmax, ``F.silu``, SDPA, cuBLAS, ``index_add_``) differs on the same kind of inputs.
Parity with the CPU kernels is ``allclose`` with the stated tolerance (transcendental
functions differ between CPU and CUDA); pure fp32 add chains are equal bit for bit.
Skips without CUDA.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tpinv.core.contract import DEFAULT_LEAVES, tree_combine
from tpinv.ops import (
    apply_rope, attention, embedding, embedding_backward, log_softmax, logsumexp, matmul, rms_norm,
    rope_cos_sin, silu_mul, softmax, sum_exp_partial, tree_sum,
)
from tpinv.testing import assert_bits_differ, assert_same_bits, same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: CPU parity (rtol, atol): fp32 differs by an ulp of exp/log/rsqrt/cos, 16-bit by one rounding.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def rand(*shape, dtype=torch.float32, seed=0, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEV)


def assert_rows_invariant(fn, x, pad_rows=5):
    """fn(row alone) == fn(rows)[row], and extra rows after them change nothing."""
    full = fn(x)
    for i in (0, x.shape[0] // 2, x.shape[0] - 1):
        assert_same_bits(fn(x[i:i + 1]), full[i:i + 1], f"row {i}")
    junk = rand(pad_rows, *x.shape[1:], dtype=x.dtype, seed=99)
    assert_same_bits(fn(torch.cat([x, junk]))[:x.shape[0]], full, "padding rows")


def assert_cpu_parity(fn, *args, dtype):
    gpu = fn(*args)
    cpu = fn(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(gpu.cpu().float(), cpu.float(), rtol=rtol, atol=atol)


# ------------------------------------------------------------------ row ops

ROW_OPS = {
    "rms_norm": lambda x: rms_norm(x, torch.linspace(0.5, 1.5, x.shape[-1], device=x.device).to(x.dtype)),
    "softmax": softmax, "log_softmax": log_softmax, "logsumexp": logsumexp,
    "silu_mul": lambda x: silu_mul(x, x.flip(-1)),
    "tree_sum": lambda x: tree_sum(x, DEFAULT_LEAVES),
}


@pytest.mark.parametrize("name", ROW_OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_alone_equals_row_in_batch_and_padding(name, dtype):
    x = rand(37, 1000, dtype=dtype, seed=len(name))
    assert_rows_invariant(ROW_OPS[name], x)
    assert_cpu_parity(ROW_OPS[name], x, dtype=dtype)


@pytest.mark.parametrize("name", ["rms_norm", "softmax", "log_softmax", "silu_mul"])
def test_input_gradient_is_row_invariant(name):
    def grad_of(x):
        x = x.detach().requires_grad_(True)
        y = ROW_OPS[name](x)
        y.backward(torch.ones_like(y) * 0.5 + torch.arange(y.shape[-1], device=DEV) % 3 - 1)
        return x.grad
    assert_rows_invariant(grad_of, rand(19, 512, dtype=torch.bfloat16, seed=3))


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 40), width=st.integers(1, 40).map(lambda n: 8 * n), seed=st.integers(0, 99))
def test_rms_norm_rows_invariant_any_shape(rows, width, seed):
    assert_rows_invariant(ROW_OPS["rms_norm"], rand(rows, width, dtype=torch.bfloat16, seed=seed))


def test_tree_sum_is_the_cpu_bits_and_ignores_zero_padding():
    x = rand(33, 999, seed=5)
    one = tree_sum(x, 1)
    assert_same_bits(one.cpu(), tree_sum(x.cpu(), 1), 'one.cpu()')          # exact adds: the CPU bits
    assert_same_bits(tree_sum(F.pad(x, (0, 25)), 1), one,
                     'tree_sum(F.pad(x, (0, 25)), 1)')       # pads to 1024 either way
    assert_same_bits(tree_sum(x[:, :992], 8).cpu(), tree_sum(x[:, :992].cpu(), 8), 'tree_sum(x[:, :992], 8).cpu()')


def test_torch_sum_differs_control():
    """torch.sum on CUDA: a row reduced alone, in a batch or zero-padded may round differently."""
    differs = []
    for n in (65536 + 5, 1 << 20):
        x = rand(64, n, seed=n)
        batch = torch.sum(x, -1)
        differs.append(not same_bits(torch.sum(x[:1], -1), batch[:1]))
        differs.append(not same_bits(torch.sum(F.pad(x, (0, 4099)), -1), batch))
        differs.append(not same_bits(x.sum(-1), tree_sum(x, 1)))
    assert any(differs)


def test_rms_norm_vanilla_differs_control():
    def vanilla(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    differs = []
    for n in (4096, 65536, 1 << 20):
        x = rand(64, n, seed=n + 1)
        full = vanilla(x)
        differs.append(not same_bits(vanilla(x[:1]), full[:1]))
        differs.append(not same_bits(vanilla(x), rms_norm(x, torch.ones(n, device=DEV))))
    assert any(differs)


# ------------------------------------------------------------------ vocab split

def split_logsumexp(x, ranks):
    slices = x.chunk(ranks, dim=-1)
    max_ = torch.stack([s.float().amax(-1) for s in slices], -1).amax(-1)
    parts = torch.stack([sum_exp_partial(s, max_, DEFAULT_LEAVES // ranks) for s in slices], -1)
    return max_, tree_combine(parts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_split_equals_unsplit(dtype):
    x = rand(6, 151936, dtype=dtype, seed=7)
    max_ = x.float().amax(-1)
    whole = sum_exp_partial(x, max_, DEFAULT_LEAVES)
    for ranks in (1, 2, 4, 8):
        m, total = split_logsumexp(x, ranks)
        assert_same_bits(m, max_, f"C={ranks}")
        assert_same_bits(total, whole, f"C={ranks}")
    assert_same_bits(logsumexp(x), (max_ + torch.log(whole)).to(dtype), 'logsumexp(x)')
    assert_cpu_parity(lambda t: sum_exp_partial(t, t.float().amax(-1), DEFAULT_LEAVES), x, dtype=dtype)


def test_vocab_split_plain_torch_differs_control():
    x = rand(6, 151936, seed=8)
    max_ = x.amax(-1, keepdim=True)
    whole = torch.exp(x - max_).sum(-1)
    split = [sum(torch.exp(s - max_).sum(-1) for s in x.chunk(c, -1)) for c in (2, 4, 8)]
    assert any(not same_bits(s, whole) for s in split)
    sm = torch.softmax(x, -1)
    composed = torch.cat([torch.exp(s - max_) / split[0].unsqueeze(-1) for s in x.chunk(2, -1)], -1)
    assert_bits_differ(sm, composed, 'sm')


# ------------------------------------------------------------------ activation, rope, embedding

def test_silu_vanilla_differs_control():
    """``F.silu(g) * u`` rounds twice in bf16: the bitwise checks above would see it."""
    g, u = rand(64, 1000, dtype=torch.bfloat16, seed=1), rand(64, 1000, dtype=torch.bfloat16, seed=2)
    assert_bits_differ(F.silu(g) * u, silu_mul(g, u), 'F.silu(g) * u')


def test_rope_tables_and_rotation_are_position_invariant():
    pos = torch.arange(300, device=DEV).expand(3, 300).contiguous()
    cos, sin = rope_cos_sin(pos, 128, 1e6)
    c1, s1 = rope_cos_sin(pos[:1, 211:212], 128, 1e6)
    assert_same_bits(c1, cos[:1, 211:212], 'c1')
    assert_same_bits(s1, sin[:1, 211:212], 's1')
    rtol, atol = TOL[torch.float32]
    c_cpu, _ = rope_cos_sin(pos.cpu(), 128, 1e6)
    torch.testing.assert_close(cos.cpu(), c_cpu, rtol=rtol, atol=atol)
    x = rand(3, 4, 300, 128, dtype=torch.bfloat16, seed=4)
    out = apply_rope(x, cos, sin)
    assert_same_bits(apply_rope(x[1:2, :, 211:212], cos[1:2, 211:212], sin[1:2, 211:212]), out[1:2, :, 211:212],
                     'apply_rope(x[1:2, :, 211:212], cos[1:2, 211:212...')
    assert_cpu_parity(apply_rope, x, cos, sin, dtype=torch.bfloat16)
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    vanilla = x * c + torch.cat((-x[..., 64:], x[..., :64]), -1) * s
    assert_bits_differ(vanilla, out, 'vanilla')     # control: a bf16 rotation rounds differently


def test_embedding_forward_and_backward_are_the_cpu_bits():
    weight = rand(500, 64, dtype=torch.bfloat16, seed=5)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 3, (8, 512), generator=gen).to(DEV)       # many repeats per row
    assert_same_bits(embedding(ids, weight), weight[ids], 'embedding(ids, weight)')
    grad = rand(8, 512, 64, seed=7)
    dw = embedding_backward(grad, ids, 500)
    assert_same_bits(dw.cpu(), embedding_backward(grad.cpu(), ids.cpu(), 500), 'dw.cpu()')
    # the first k tokens: a prefix of the token-order chain, computed alone
    assert_same_bits(embedding_backward(grad[:1], ids[:1], 500)[:3].cpu(), embedding_backward(grad[:1].cpu(), ids[:1].cpu(), 500)[:3],
                     'embedding_backward(grad[:1], ids[:1], 500)[:3]....')
    atomic = [torch.zeros(500, 64, device=DEV).index_add_(0, ids.reshape(-1), grad.reshape(-1, 64))
              for _ in range(3)]
    assert any(not same_bits(a, dw) for a in atomic)   # control: atomics add in another order


# ------------------------------------------------------------------ attention

def attn_inputs(S=29, T=None, B=2, Hq=4, Hkv=2, D=64, seed=0):
    T = T or S
    q = rand(B, Hq, S, D, dtype=torch.bfloat16, seed=seed, scale=1.0)
    k = rand(B, Hkv, T, D, dtype=torch.bfloat16, seed=seed + 1, scale=1.0)
    v = rand(B, Hkv, T, D, dtype=torch.bfloat16, seed=seed + 2, scale=1.0)
    return q, k, v


def test_attention_prefill_equals_decode_and_padding():
    S = 29
    q, k, v = attn_inputs(S)
    pos = torch.arange(S, device=DEV).expand(2, S).contiguous()
    prefill = attention(q, k, v, pos)
    for i in (0, 13, S - 1):     # one query against the whole key buffer (a KV cache)
        step = attention(q[:, :, i:i + 1], k, v, pos[:, i:i + 1].contiguous())
        assert_same_bits(step, prefill[:, :, i:i + 1], f"decode step {i}")
    _, kj, vj = attn_inputs(S, T=S + 35, seed=9)        # key slots past the queries: junk
    kp, vp = torch.cat([k, kj[:, :, S:]], 2), torch.cat([v, vj[:, :, S:]], 2)
    assert_same_bits(attention(q, kp, vp, pos), prefill, 'attention(q, kp, vp, pos)')
    assert_same_bits(attention(q[1:], k[1:], v[1:], pos[1:]), prefill[1:], 'attention(q[1:], k[1:], v[1:], pos[1:])')
    assert_cpu_parity(lambda *a: attention(*a), q, k, v, pos, dtype=torch.bfloat16)


def test_attention_gradients_are_batch_invariant():
    q, k, v = attn_inputs(17)
    pos = torch.arange(17, device=DEV).expand(2, 17).contiguous()

    def grads(sl):
        leaves = [t[sl].detach().requires_grad_(True) for t in (q, k, v)]
        attention(*leaves, pos[sl]).backward(torch.ones_like(leaves[0]))
        return [t.grad for t in leaves]
    full, alone = grads(slice(0, 2)), grads(slice(1, 2))
    for a, f in zip(alone, full):
        assert_same_bits(a, f[1:], 'a')


def test_sdpa_prefill_decode_differs_control():
    differs = []
    for T in (256, 1000, 2048):
        q, k, v = attn_inputs(T, B=1, Hq=8, Hkv=8, D=128, seed=T)
        prefill = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        for i in (T // 2, T - 1):
            step = F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1])
            differs.append(not same_bits(step, prefill[:, :, i:i + 1]))
    assert any(differs)


# ------------------------------------------------------------------ matmul (Triton)

def test_matmul_row_invariant_and_cublas_differs_control():
    x, w = rand(1000, 4096, dtype=torch.bfloat16, seed=1), rand(1024, 4096, dtype=torch.bfloat16, seed=2)
    full = matmul(x, w)
    for i in (0, 511, 999):
        assert_same_bits(matmul(x[i:i + 1], w), full[i:i + 1], 'matmul(x[i:i + 1], w)')
    xs, ws = x[:37, :256], w[:96, :256]
    assert_cpu_parity(matmul, xs, ws, dtype=torch.bfloat16)   # CPU and GPU bits may differ
    ref = x @ w.T
    assert any(not same_bits(x[i:i + m] @ w.T, ref[i:i + m]) for i, m in ((0, 1), (5, 3), (100, 64)))
