"""Triton attention on CUDA: a query's bits do not depend on the call (prefill, chunk, decode,
batch, padding); gradients likewise; parity with an fp64 reference.

Invariance is asserted bitwise (``assert_same_bits``: shape, dtype and raw bytes) at realistic sizes (bf16, Hq=8, Hkv=2,
D=128, S and T 300..1100); beside each check a negative control shows that torch's SDPA
differs in the same comparison.  Parity: relative error (Frobenius) against fp64 of at most
twice SDPA's own error plus a small floor (stated per test).  Skips without CUDA.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tpinv.kernels.reference_attention import block_visibility
from tpinv.testing import assert_same_bits, same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

if torch.cuda.is_available():
    from tpinv.kernels.triton_attention import attention_forward_cuda
    from tpinv.kernels.triton_attention_bwd import attention_backward_cuda

DEV = "cuda"
BF16 = torch.bfloat16
NAN = float("nan")
HQ, HKV, D = 8, 2, 128


def rand(*shape, dtype=BF16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEV)


def qkv(B, S, T, seed=0, dtype=BF16, d=D):
    return (rand(B, HQ, S, d, dtype=dtype, seed=seed),
            rand(B, HKV, T, d, dtype=dtype, seed=seed + 1),
            rand(B, HKV, T, d, dtype=dtype, seed=seed + 2))


def arange_pos(B, S, start=0):
    return (torch.arange(S, device=DEV) + start).expand(B, S).contiguous()


def vis_of(pos, T, causal=True, window=None, mask=None):
    """The op's visibility rule, bool [B, S, T] (the CPU kernel's own function)."""
    return block_visibility(pos, 0, T, causal, window, mask)


def fwd(q, k, v, pos, mask=None, causal=True, window=None):
    return attention_forward_cuda(q, k, v, pos, mask, causal, window, None)


def sdpa(q, k, v, vis):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=vis[:, None], enable_gqa=True)


def reference(q, k, v, vis):
    """fp64 ``(out, lse)``; a row that sees nothing: out 0, lse -inf."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q @ k.mT) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~vis[:, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def with_junk(x, T, junk=NAN):
    cache = torch.full((*x.shape[:2], T, x.shape[3]), junk, dtype=x.dtype, device=DEV)
    cache[:, :, :x.shape[2]] = x
    return cache


# ------------------------------------------------------------------ forward parity

@pytest.mark.parametrize("mode", ["causal", "window", "mask", "full"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_forward_parity_with_fp64(dtype, mode):
    B, S, T = 2, 300, 517
    q, k, v = qkv(B, S, T, seed=3, dtype=dtype)
    pos = arange_pos(B, S, T - S)
    causal, window, mask = mode != "full", 200 if mode == "window" else None, None
    if mode == "mask":
        mask = torch.rand(B, S, T, generator=torch.Generator().manual_seed(1)).to(DEV) < 0.7
        mask[:, :5] = False  # rows that see nothing
    out, lse = fwd(q, k, v, pos, mask, causal, window)
    vis = vis_of(pos, T, causal, window, mask)
    ref_o, ref_l = reference(q, k, v, vis)
    van = sdpa(q, k, v, vis).nan_to_num()
    floor = {BF16: 5e-3, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    assert rel(out, ref_o) <= 2 * rel(van, ref_o) + floor, (rel(out, ref_o), rel(van, ref_o))
    seen = torch.isfinite(ref_l)
    assert_same_bits(torch.isfinite(lse), seen, 'torch.isfinite(lse)')
    assert (lse[seen].double() - ref_l[seen]).abs().max().item() < 1e-4
    assert_same_bits(out[~seen[..., None].expand_as(out)].float().abs().sum().cpu(), torch.tensor(0.0),
                     'out[~seen[..., None].expand_as(out)].float().ab...')


# ------------------------------------------------------------------ forward invariance

@pytest.mark.parametrize("window", [None, 300], ids=["causal", "W300"])
def test_prefill_equals_chunked_prefill_and_decode(window):
    B, S, T_cache = 2, 700, 1100
    q, k, v = qkv(B, S, S, seed=5)
    pos = arange_pos(B, S)
    full, full_lse = fwd(q, k, v, pos, window=window)
    kc, vc = with_junk(k, T_cache), with_junk(v, T_cache)  # NaN in unused cache slots
    for chunk in (37, 128, 333):
        for c0 in range(0, S, chunk):
            c1 = min(S, c0 + chunk)
            part, part_lse = fwd(q[:, :, c0:c1], kc, vc, pos[:, c0:c1].contiguous(), window=window)
            assert_same_bits(part, full[:, :, c0:c1], f"chunk {chunk} at {c0}")
            assert_same_bits(part_lse, full_lse[:, :, c0:c1], f"lse chunk {chunk} at {c0}")
    steps = torch.tensor([[0, 63, 64, 299, 511, 699], [1, 127, 128, 300, 640, 698]], device=DEV)
    for i in range(steps.shape[1]):  # a decode batch: each sequence at its own position
        s = steps[:, i]
        qd = q[torch.arange(B), :, s][:, :, None]
        step, _ = fwd(qd, kc, vc, s[:, None].contiguous(), window=window)
        assert_same_bits(step, full[torch.arange(B), :, s][:, :, None], f"decode {s.tolist()}")
    # control: SDPA's prefill row and its decode step differ
    van_full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    steps = [F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1],
                                            enable_gqa=True) for i in (299, 511, 699)]
    differs = [not same_bits(x, van_full[:, :, i:i + 1]) for x, i in zip(steps, (299, 511, 699))]
    assert any(differs), "control: SDPA prefill and decode never differed"


def test_ragged_batch_right_and_left_padding_equal_alone():
    lengths, T = [300, 1100, 517, 64], 1100
    reqs = [qkv(1, L, L, seed=10 + i) for i, L in enumerate(lengths)]
    B = len(lengths)
    q_r, q_l = rand(B, HQ, T, D, seed=1), rand(B, HQ, T, D, seed=2)
    k, v = (torch.full((B, HKV, T, D), NAN, dtype=BF16, device=DEV) for _ in range(2))
    pos_l = torch.zeros(B, T, dtype=torch.int64, device=DEV)
    for b, (rq, rk, rv) in enumerate(reqs):
        L = rq.shape[2]
        q_r[b, :, :L], k[b, :, :L], v[b, :, :L] = rq[0], rk[0], rv[0]
        q_l[b, :, T - L:] = rq[0]           # left padding: junk query rows first
        pos_l[b, T - L:] = torch.arange(L, device=DEV)
    right, _ = fwd(q_r, k, v, arange_pos(B, T))
    left, _ = fwd(q_l, k, v, pos_l)
    van_batch = sdpa(q_r, k.nan_to_num(), v.nan_to_num(), vis_of(arange_pos(B, T), T))
    van_differs = False
    for b, (rq, rk, rv) in enumerate(reqs):
        L = rq.shape[2]
        alone, _ = fwd(rq, rk, rv, arange_pos(1, L))
        assert_same_bits(alone, right[b:b + 1, :, :L], f"right padding, length {L}")
        assert_same_bits(alone, left[b:b + 1, :, T - L:], f"left padding, length {L}")
        # control: SDPA the usual way, causal flash alone and a boolean mask for the batch
        van_alone = F.scaled_dot_product_attention(rq, rk, rv, is_causal=True, enable_gqa=True)
        van_differs |= not same_bits(van_alone, van_batch[b:b + 1, :, :L])
    assert van_differs, "control: SDPA alone and in the padded batch never differed"


def test_masked_and_unmasked_paths_give_the_same_bits():
    """An all-True mask and a window wider than T take the masked path everywhere, forward and
    backward."""
    B, S = 2, 600
    q, k, v = qkv(B, S, S, seed=7)
    pos = arange_pos(B, S)
    ref, ref_lse = fwd(q, k, v, pos)
    ones = torch.ones(B, S, S, dtype=torch.bool, device=DEV)
    for kw in (dict(mask=ones), dict(window=10 ** 6), dict(mask=ones, window=10 ** 6)):
        out, lse = fwd(q, k, v, pos, **kw)
        assert_same_bits(out, ref, str(kw))
        assert_same_bits(lse, ref_lse, str(kw))
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D] memory
    assert_same_bits(fwd(strided, k, v, pos)[0], ref, 'fwd(strided, k, v, pos)[0]')
    # the backward: without a mask or window, row tiles that see a whole key block skip the
    # visibility test; with either, every tile takes it
    dout = rand(B, HQ, S, D, seed=9)
    want = attention_backward_cuda(dout, None, q, k, v, ref, ref_lse, pos, None, True, None, None)
    for kw in (dict(mask=ones), dict(window=10 ** 6), dict(mask=ones, window=10 ** 6)):
        got = attention_backward_cuda(dout, None, q, k, v, ref, ref_lse, pos, kw.get("mask"), True,
                                      kw.get("window"), None)
        for name, a, b in zip("qkv", got, want):
            assert_same_bits(a, b, f"d{name} {kw}")
    hidden = ones.clone()
    hidden[0, S - 1, 5] = False        # control: one row no longer sees key 5
    moved = attention_backward_cuda(dout, None, q, k, v, ref, ref_lse, pos, hidden, True, None, None)
    assert not same_bits(moved[1][0, :, 5], want[1][0, :, 5]), "control: hiding a key from a row moved nothing"


def test_empty_and_blind_queries():
    q, k, v = qkv(2, 5, 70, seed=8)
    out, lse = fwd(q[:, :, :0], k, v, arange_pos(2, 0))
    assert out.shape == (2, HQ, 0, D) and lse.shape == (2, HQ, 0)
    out, lse = fwd(q, k[:, :, :0], v[:, :, :0], arange_pos(2, 5))
    assert not out.any() and torch.isneginf(lse).all()
    out, lse = fwd(q, k, v, arange_pos(2, 5, start=-10))  # positions before every slot
    assert not out.any() and torch.isneginf(lse).all()


# ------------------------------------------------------------------ backward

def grads_ours(q, k, v, pos, dout, dlse=None, mask=None, window=None):
    out, lse = fwd(q, k, v, pos, mask, True, window)
    return attention_backward_cuda(dout, dlse, q, k, v, out, lse, pos, mask, True, window, None)


def grads_autograd(q, k, v, vis, dout, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    if dtype == torch.float64:
        out = reference(*leaves, vis)[0]
    else:
        out = sdpa(*leaves, vis)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


def test_backward_writes_every_gradient_element():
    """dQ/dK/dV are allocated without a zero fill: the kernels store every element.  Memory the
    allocator hands back is poisoned with NaN first; keys no query sees (past a window, masked)
    and queries that see no key get exact zeros, every other entry is finite.  Control: the
    poisoned block is the one the gradients reuse (a fresh empty tensor of dQ's size reads NaN)."""
    B, S, T = 2, 70, 70
    q, k, v = qkv(B, S, T, seed=21)
    pos = arange_pos(B, S, start=-3)                    # the first 3 queries see no key
    mask = torch.ones(B, S, T, dtype=torch.bool, device=DEV)
    mask[:, :, 40:50] = False                           # keys 40-49: seen by no query
    dout = rand(B, HQ, S, D, seed=22)
    out, lse = fwd(q, k, v, pos, mask, True, 16)
    sizes = [q.numel(), k.numel(), v.numel()]
    poison = [torch.full((n,), NAN, dtype=BF16, device=DEV) for n in sizes]
    del poison
    probe = torch.empty(q.numel(), dtype=BF16, device=DEV)
    assert probe.isnan().all(), "control: the allocator hands back the poisoned block"
    del probe
    poison = [torch.full((n,), NAN, dtype=BF16, device=DEV) for n in sizes]
    del poison
    dq, dk, dv = attention_backward_cuda(dout, None, q, k, v, out, lse, pos, mask, True, 16, None)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not g.isnan().any(), f"{name} holds an unwritten (NaN-poisoned) element"
    assert not dq[:, :, :3].any(), "queries with no visible key: dq is exactly zero"
    assert not dk[:, :, 40:50].any() and not dv[:, :, 40:50].any(), "keys no query sees: zero dk, dv"
    assert dk[:, :, :40].abs().sum() > 0 and dq[:, :, 3:].abs().sum() > 0


@pytest.mark.parametrize("window", [None, 200], ids=["causal", "W200"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_gradients_match_fp64_autograd(dtype, window):
    B, S, T = 2, 300, 420
    q, k, v = qkv(B, S, T, seed=11, dtype=dtype)
    pos = arange_pos(B, S, T - S)
    dout = rand(B, HQ, S, D, dtype=dtype, seed=12)
    vis = vis_of(pos, T, window=window)
    ours = grads_ours(q, k, v, pos, dout, window=window)
    ref = grads_autograd(q, k, v, vis, dout, torch.float64)
    van = grads_autograd(q, k, v, vis, dout)
    floor = 1e-2 if dtype == BF16 else 1e-5
    for name, o, r, w in zip("qkv", ours, ref, van):
        assert rel(o, r) <= 2 * rel(w, r) + floor, (name, rel(o, r), rel(w, r))


def _per_head_rel(x, ref):
    """Relative error of each (batch row, head) of ``[B, H, T, D]`` gradients against fp64."""
    x, ref = x.double(), ref.double()
    return ((x - ref).flatten(2).norm(dim=-1) / ref.flatten(2).norm(dim=-1).clamp_min(1e-30))


@pytest.mark.parametrize("heads", [(8, 8), (16, 8), (8, 2)], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", [(3, 77, 77), (2, 333, 700)], ids=["77", "333x700"])
def test_dk_dv_of_every_head_match_fp64_and_repeat(heads, causal, shape):
    """dK and dV of every (batch row, kv head) within twice SDPA's own error of fp64 plus 1e-3,
    and the same bytes on every call.  A whole-tensor error bound can hide one wrong head (a
    dK/dV kernel that misordered its shared-memory reuse left one head's dK five times off while
    the tensor's error stayed within 0.015); control: one key slot's dK zeroed fails the bound."""
    (hq, hkv), (B, S, T) = heads, shape
    q = rand(B, hq, S, D, seed=70)
    k, v = rand(B, hkv, T, D, seed=71), rand(B, hkv, T, D, seed=72)
    pos = arange_pos(B, S, T - S)
    dout = rand(B, hq, S, D, seed=73)
    out, lse = fwd(q, k, v, pos, None, causal)
    grads = [attention_backward_cuda(dout, None, q, k, v, out, lse, pos, None, causal, None, None)
             for _ in range(3)]
    for again in grads[1:]:
        for name, a, b in zip("qkv", again, grads[0]):
            assert_same_bits(a, b, f"d{name} on a repeated call")
    vis = vis_of(pos, T, causal=causal)
    ref = grads_autograd(q, k, v, vis, dout, torch.float64)
    van = grads_autograd(q, k, v, vis, dout)
    for name, o, r, w in zip("kv", grads[0][1:], ref[1:], van[1:]):
        bound = 2 * _per_head_rel(w, r) + 1e-3
        err = _per_head_rel(o, r)
        assert (err <= bound).all(), (f"d{name}", err.max().item(), bound.min().item())
    broken = grads[0][1].clone()
    broken[0, 0, T // 2] = 0
    assert not (_per_head_rel(broken, ref[1]) <= 2 * _per_head_rel(van[1], ref[1]) + 1e-3).all(), \
        "control: a zeroed key slot passed the per-head bound"


def test_grad_lse_matches_fp64_autograd():
    B, S = 1, 300
    q, k, v = qkv(B, S, S, seed=13, dtype=torch.float32)
    pos = arange_pos(B, S)
    dout = rand(B, HQ, S, D, dtype=torch.float32, seed=14)
    dlse = rand(B, HQ, S, dtype=torch.float32, seed=15)
    ours = grads_ours(q, k, v, pos, dout, dlse)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o, l = reference(*leaves, vis_of(pos, S))
    ref = torch.autograd.grad((o * dout.double()).sum() + (l * dlse.double()).sum(), leaves)
    for name, a, r in zip("qkv", ours, ref):
        assert rel(a, r) < 1e-5, name


def test_gradients_alone_equal_gradients_in_right_padded_batch():
    lengths, T = [300, 1100, 517, 64], 1100
    reqs = [qkv(1, L, L, seed=20 + i) for i, L in enumerate(lengths)]
    B = len(lengths)
    q, k, v = rand(B, HQ, T, D, seed=3), rand(B, HKV, T, D, seed=4), rand(B, HKV, T, D, seed=5)
    dout = torch.zeros_like(q)  # padding rows carry no loss
    d_alone = [rand(1, HQ, L, D, seed=30 + i) for i, L in enumerate(lengths)]
    for b, (rq, rk, rv) in enumerate(reqs):
        L = rq.shape[2]
        q[b, :, :L], k[b, :, :L], v[b, :, :L], dout[b, :, :L] = rq[0], rk[0], rv[0], d_alone[b][0]
    pos = arange_pos(B, T)
    batch = grads_ours(q, k, v, pos, dout)
    van_batch = grads_autograd(q, k, v, vis_of(pos, T), dout)
    van_differs = False
    for b, (rq, rk, rv) in enumerate(reqs):
        L = rq.shape[2]
        alone = grads_ours(rq, rk, rv, arange_pos(1, L), d_alone[b])
        for name, a, full in zip("qkv", alone, batch):
            assert_same_bits(a, full[b:b + 1, :, :L], f"d{name}, length {L}")
        van_alone = grads_autograd(rq, rk, rv, vis_of(arange_pos(1, L), L), d_alone[b])
        van_differs |= any(not same_bits(a, full[b:b + 1, :, :L])
                           for a, full in zip(van_alone, van_batch))
    assert van_differs, "control: SDPA gradients alone and in the batch never differed"


def test_dq_of_a_chunk_equals_dq_of_the_prefill():
    """dQ is per row: a chunk of queries against the cache gives the prefill's bits."""
    B, S = 1, 640
    q, k, v = qkv(B, S, S, seed=40)
    pos = arange_pos(B, S)
    dout = rand(B, HQ, S, D, seed=41)
    full = grads_ours(q, k, v, pos, dout)
    c0, c1 = 200, 333
    part = grads_ours(q[:, :, c0:c1], k, v, pos[:, c0:c1].contiguous(), dout[:, :, c0:c1])
    assert_same_bits(part[0], full[0][:, :, c0:c1], 'part[0]')
