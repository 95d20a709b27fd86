"""Triton attention on CUDA by chunks in parallel (decode, short chunked prefill): the bits of
one program per row tile.

The split launch (:mod:`tpinv.kernels.triton_attention_split`) gives the one-program forward's
raw bytes (``assert_same_bits``) in every dtype and mask mode, eagerly and replayed from CUDA
graphs, with launches in turn sharing counters that each leaves at zero.  Controls: a chunk's
state dropped from the merge moves ``lse``; a counter not at zero merges nothing.  Skips without
CUDA.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.testing import assert_same_bits
from tpinv.testing.split_launch import assert_split_launch

from test_triton_attention import BF16, DEV, HKV, HQ, D, NAN, arange_pos, qkv, with_junk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

if torch.cuda.is_available():
    from tpinv.kernels.triton_attention import attention_forward_cuda


@pytest.mark.parametrize("mode", ["causal", "window", "mask", "full"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_chunks_in_parallel_give_the_one_program_bits(dtype, mode):
    """Decode and a short chunked prefill by chunks in parallel (one launch) == one program
    per row tile, raw bytes, the launches sharing counters that each leaves at zero; controls:
    with the chunk of a row's largest score dropped from the written states, the merge gives
    that row another lse; a counter not at zero merges nothing."""
    from tpinv.kernels import triton_attention as ta
    from tpinv.kernels import triton_attention_split as sp
    from tpinv.kernels.reference_attention import KV_BLOCK
    T, T_cache = 3000, 3300
    chunk = KV_BLOCK * ta.KV_CHUNK_BLOCKS
    causal, window = mode != "full", 900 if mode == "window" else None
    for B, S in ((1, 1), (3, 1), (2, 5)):
        q, k, v = qkv(B, S, T, seed=11 * B + S, dtype=dtype)
        k[:, 0, chunk + 7] = 4 * q[:, 0, -1]  # the last row's largest score: chunk 1
        pos = arange_pos(B, S, T - S)
        pos[0] -= 333  # batch rows at different positions
        mask = None
        if mode == "mask":
            mask = torch.rand(B, S, T_cache, generator=torch.Generator().manual_seed(2)).to(DEV) < 0.7
            mask[:, :, 2 * chunk:3 * chunk] = False  # a chunk no row sees
            mask[:, :, chunk + 7] = True
        # NaN in the cache's unused slots, which causal rows never see
        kc, vc = (with_junk(k, T_cache), with_junk(v, T_cache)) if causal else (k, v)
        if mask is not None:
            mask = mask[:, :, :kc.shape[2]].contiguous()
        one = attention_forward_cuda(q, kc, vc, pos, mask, causal, window, None, split=False)
        par = attention_forward_cuda(q, kc, vc, pos, mask, causal, window, None, split=True,
                                     gluon=False)
        auto = attention_forward_cuda(q, kc, vc, pos, mask, causal, window, None)
        assert sp.use_split(B, HKV, S * HQ // HKV, ta.forward_config(dtype, D).block_m, kc.shape[2],
                            KV_BLOCK, ta.KV_CHUNK_BLOCKS, D)
        for a, b, c in zip(one, par, auto):
            assert_same_bits(b, a, f"split B={B} S={S}")
            assert_same_bits(c, a, f"auto B={B} S={S}")
        if mode == "window":
            continue  # the window hides chunk 1 from the last rows
        launch = sp.SplitLaunch(q, kc, vc, pos, *ta.mask_args(mask, q), HQ // HKV, causal, window,
                                ta.resolve_scale(None, D), mask is not None,
                                ta.forward_config(dtype, D), D, KV_BLOCK, ta.KV_CHUNK_BLOCKS)
        out, lse, acc_st, ml_st = assert_split_launch(launch, par, B * HKV, gluon=False)
        acc_st[:, 1] = 0.0
        ml_st[:, 1, :, 0] = float("-inf")
        ml_st[:, 1, :, 1] = 0.0
        sp.merge_chunks_cuda(launch, acc_st, ml_st, out, lse)
        assert (lse[:, 0, -1] < par[1][:, 0, -1] - 1.0).all(), "control: the dropped chunk is missed"


@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_chunks_in_parallel_captured_replays_give_the_same_bits(gluon):
    """Split launches captured into two CUDA graphs (counters of their own, no memset node),
    replayed in turn and interleaved with eager split launches on the same inputs: every
    replay gives the one-program bytes, and every captured launch leaves its counters at 0; the
    Triton kernel's launch and the Gluon kernel's (an sm_90 GPU)."""
    from tpinv.kernels import launch_counters, triton_attention_split as sp
    if gluon and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon decode kernel needs an sm_90 GPU")
    cases = [qkv(B, 1, T, seed=B + T) + (arange_pos(B, 1, T - 1),)
             for B, T in ((1, 3000), (4, 2100))]
    want = [attention_forward_cuda(q, k, v, p, None, True, None, None, split=False)
            for q, k, v, p in cases]
    for q, k, v, p in cases:  # warm-up outside capture (makes the captured counters' store)
        attention_forward_cuda(q, k, v, p, None, True, None, None, split=True, gluon=gluon)
    torch.cuda.synchronize()
    graphs, got = [], []
    for q, k, v, p in cases:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got.append(attention_forward_cuda(q, k, v, p, None, True, None, None, split=True,
                                              gluon=gluon))
        graphs.append(g)
    store, used = launch_counters._CAPTURED[torch.device(DEV, torch.cuda.current_device())]
    assert used >= 1 * HKV + 4 * HKV, "the captured launches took counters of their own"
    for _ in range(3):
        for g, (o, l), (wo, wl), (q, k, v, p) in zip(graphs, got, want, cases):
            o.fill_(NAN)
            g.replay()
            eager = attention_forward_cuda(q, k, v, p, None, True, None, None, split=True,
                                           gluon=gluon)
            torch.cuda.synchronize()
            assert_same_bits(o, wo, "replayed out")
            assert_same_bits(l, wl, "replayed lse")
            assert_same_bits(eager[0], wo, "eager between replays")
    assert not store[:used].any(), "captured launches leave their counters at 0"


def test_split_refuses_rows_of_several_tiles():
    q, k, v = qkv(1, 40, 2000)
    with pytest.raises(ValueError, match="one row tile"):
        attention_forward_cuda(q, k, v, arange_pos(1, 40, 1960), None, True, None, None, split=True)
