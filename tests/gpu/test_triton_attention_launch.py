"""Triton attention on CUDA: a launch shape never moves a bit.

Every row tile, warp count and pipeline depth of the forward, dK/dV and dQ kernels that the
tables may pick gives the tables' bytes, and so does the forward's kernel that holds no merged
state (calls whose keys lie in the first chunk) against the merging one, and so do tiles read
through TMA descriptors against pointer loads.  The sums inside run
through wgmma instructions chained in k16 steps whatever the tile, so this is a fixed order,
not luck: each test's control changes one input and sees its output move.  Skips without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.testing import assert_same_bits, same_bits

from test_triton_attention import HQ, HKV, D, arange_pos, fwd, qkv, rand, vis_of, with_junk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

if torch.cuda.is_available():
    from tpinv.kernels import triton_attention as ta
    from tpinv.kernels.reference_attention import KV_BLOCK
    from tpinv.kernels.triton_attention import attention_forward_cuda
    from tpinv.kernels import triton_attention_bwd as tb
    from tpinv.kernels.triton_attention_bwd import attention_backward_cuda


def inputs(case, B, S, T, seed):
    q, k, v = qkv(B, S, T, seed=seed)
    pos = arange_pos(B, S, T - S)
    mask = window = None
    causal = True
    if case == "window":
        window = 150
    elif case == "mask":
        mask = vis_of(pos, T)
        mask[:, :, 5::7] = False
    elif case == "full":
        causal = False
    elif case == "decode-chunk":
        q, pos = q[:, :, -17:].contiguous(), pos[:, -17:].contiguous()
    return q, k, v, pos, mask, causal, window


@pytest.mark.parametrize("T", [300, 700])
@pytest.mark.parametrize("case", ["causal", "window", "mask", "full", "decode-chunk"])
def test_forward_launch_shapes_do_not_move_bits(case, T):
    """Every candidate config gives the table's ``out`` and ``lse`` bytes, keys in one chunk
    (T = 300) or in two (T = 700); one-chunk calls also with the merging kernel forced."""
    assert ta.one_chunk(300) and not ta.one_chunk(700)
    q, k, v, pos, mask, causal, window = inputs(case, 2, 333 if T > 333 else 250, T, seed=70)
    args = (q, k, v, pos, mask, causal, window, None)
    want = attention_forward_cuda(*args, split=False)
    merges = (None, True) if ta.one_chunk(T) else (None,)
    for cfg in ta.FORWARD_CANDIDATES:
        for merge in merges:
            got = attention_forward_cuda(*args, split=False, config=cfg, merge=merge)
            for name, a, b in zip(("out", "lse"), got, want):
                assert_same_bits(a, b, f"{name} {cfg} merge={merge}")
    v2 = v.clone()
    v2[1, 0, T - 3] += 1.0  # a slot the last rows see in every case (window, mask and decode too)
    moved = attention_forward_cuda(q, k, v2, pos, mask, causal, window, None, split=False)
    assert not same_bits(moved[0][1, 0], want[0][1, 0]), "control: a changed value moved nothing"


def test_one_chunk_call_runs_without_the_merge_and_equals_a_longer_cache(monkeypatch):
    """Keys in one chunk launch the kernel without merged state (asserted on the launch), and
    its bytes equal the merging kernel's over a cache that spans two chunks, whose extra slots
    hold NaN and are seen by no row."""
    B, S, T = 2, 250, 300
    q, k, v = qkv(B, S, T, seed=80)
    pos = arange_pos(B, S, T - S)
    seen = []
    real = ta.launch

    def spy(fn, grid, *args, **kwargs):
        if fn is ta._attn_fwd_kernel:
            seen.append((kwargs["MERGE"], kwargs["BLOCK_M"]))
        return real(fn, grid, *args, **kwargs)

    monkeypatch.setattr(ta, "launch", spy)
    short = fwd(q, k, v, pos)
    cap = KV_BLOCK * ta.KV_CHUNK_BLOCKS + 200
    long = fwd(q, with_junk(k, cap), with_junk(v, cap), pos)
    monkeypatch.undo()
    block_m = ta.forward_config(q.dtype, D).block_m
    assert seen == [(False, block_m), (True, block_m)], seen
    for a, b in zip(short, long):
        assert_same_bits(a, b, "one chunk vs two")
    k2 = k.clone()
    k2[0, 1, 3] += 1.0
    moved = fwd(q, k2, v, pos)
    assert not same_bits(moved[0][0, HQ // 2], short[0][0, HQ // 2]), "control: a changed key moved nothing"


@pytest.mark.parametrize("case", ["causal", "window", "mask", "decode-chunk"])
def test_backward_launch_shapes_do_not_move_bits(case):
    """Every candidate tiling of the dK/dV and dQ kernels gives the table's bytes (the sums reduce
    over rows or slots through dots chained in k16 steps, whatever the tile); a fixed order, not
    luck: the control below changes one key and sees its dK row move."""
    from tpinv.kernels.triton_attention_bwd import BACKWARD_CANDIDATES
    T = 700
    q, k, v, pos, mask, _, window = inputs(case, 2, 333, T, seed=60)
    dout = rand(*q.shape, seed=61)
    dlse = rand(*q.shape[:3], dtype=torch.float32, seed=62)
    out, lse = fwd(q, k, v, pos, mask, True, window)
    args = (dout, dlse, q, k, v, out, lse, pos, mask, True, window, None)
    want = attention_backward_cuda(*args)
    for cfg in BACKWARD_CANDIDATES:
        got = attention_backward_cuda(*args, config=cfg)
        for name, a, b in zip("qkv", got, want):
            assert_same_bits(a, b, f"d{name} {cfg}")
    k2 = k.clone()
    k2[1, 0, T - 40] += 1.0
    moved = attention_backward_cuda(dout, dlse, q, k2, v, out, lse, pos, mask, True, window, None)
    assert not same_bits(moved[1][1, 0, T - 40], want[1][1, 0, T - 40]), "control: a changed key moved nothing"


def spy_tma(monkeypatch):
    """Record ``(kernel name, TMA)`` of every forward, dK/dV and dQ launch."""
    seen = []
    for module in (ta, tb):
        real = module.launch

        def spy(fn, grid, *args, _real=real, **kwargs):
            if "TMA" in kwargs:
                seen.append((fn.__name__, kwargs["TMA"]))
            return _real(fn, grid, *args, **kwargs)

        monkeypatch.setattr(module, "launch", spy)
    return seen


def bshd(x):
    """``x`` [B, H, S, D] with the memory layout of a projection's ``[B, S, H, D]`` output."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("case", ["causal", "window", "mask", "full", "decode-chunk", "d80"])
def test_tma_loads_give_the_pointer_loads_bits(case, monkeypatch):
    """Tiles read through TMA descriptors (K/V blocks in the forward and dQ; the interleaved query
    rows of every kv head in dK/dV and dQ, as ``[B, S, Hkv, g, D]`` boxes) give the pointer
    loads' bytes, for head-major and ``[B, S, H, D]``-strided q and grad_out, a head dim below
    its padding (80 of 128) too.  The descriptor path is asserted on the launches; the dK/dV
    kernel takes it without a window or mask only.  Control: a changed value slot moves ``out``."""
    T = 700
    if case == "d80":
        q, k, v = qkv(2, 333, T, seed=90, d=80)
        pos, mask, causal, window = arange_pos(2, 333, T - 333), None, True, None
    else:
        q, k, v, pos, mask, causal, window = inputs(case, 2, 333, T, seed=90)
    dout = rand(*q.shape, seed=91)
    dlse = rand(*q.shape[:3], dtype=torch.float32, seed=92)
    fargs = (pos, mask, causal, window, None)
    want = attention_forward_cuda(q, k, v, *fargs, split=False, tma=False)
    bwant = attention_backward_cuda(dout, dlse, q, k, v, *want, *fargs, tma=False)
    seen = spy_tma(monkeypatch)
    for qq, dd in ((q, dout), (bshd(q), bshd(dout))):
        got = attention_forward_cuda(qq, k, v, *fargs, split=False)
        for name, a, b in zip(("out", "lse"), got, want):
            assert_same_bits(a.contiguous(), b, name)
        bgot = attention_backward_cuda(dd, dlse, qq, k, v, *want, *fargs)
        for name, a, b in zip("qkv", bgot, bwant):
            assert_same_bits(a.contiguous(), b, f"d{name}")
    monkeypatch.undo()
    dkdv_tma = window is None and mask is None
    assert seen == 2 * [("_attn_fwd_kernel", True), ("dkdv_kernel", dkdv_tma), ("_dq_kernel", True)], seen
    v2 = v.clone()
    v2[1, 0, T - 3] += 1.0
    moved = attention_forward_cuda(q, k, v2, *fargs, split=False)
    assert not same_bits(moved[0][1, 0], want[0][1, 0]), "control: a changed value moved nothing"


def test_tma_where_descriptors_cannot_read_is_refused_or_skipped():
    """``tma=True`` raises where no descriptor can read the tensors (fp32; a window for dK/dV);
    ``tma=None`` then takes the pointer loads, and a k/v stride off the 16-byte grid does too."""
    q, k, v = qkv(1, 40, 40, seed=95, dtype=torch.float32)
    pos = arange_pos(1, 40)
    with pytest.raises(ValueError, match="TMA"):
        attention_forward_cuda(q, k, v, pos, tma=True)
    q, k, v = qkv(1, 40, 40, seed=96)
    out, lse = attention_forward_cuda(q, k, v, pos, window=8)
    with pytest.raises(ValueError, match="window or mask"):
        attention_backward_cuda(out, None, q, k, v, out, lse, pos, None, True, 8, None, tma=True)
    wide = rand(1, HKV, 40, D + 4, seed=97)[..., :D]     # row stride D + 4: not 16-byte aligned
    assert ta.kv_descriptors(wide, wide, KV_BLOCK, D) is None
    assert_same_bits(attention_forward_cuda(q, wide, wide, pos, split=False)[0],
                     attention_forward_cuda(q, wide.contiguous(), wide.contiguous(), pos, split=False,
                                            tma=False)[0], "unaligned k/v")
