"""The Gluon decode kernel (:mod:`tpinv.kernels.gluon_attention_decode`, sm_90): the bits of one
program per row tile.

Forced with ``gluon=True`` (so the kernel surely ran), its launch gives the one-program
forward's raw bytes (``assert_split_launch``: out, lse, counters left at zero, its states merged
again by the Triton kernel) in both 16-bit dtypes, causal and not, with batch rows at different
positions, several query rows, NaN in the cache's unused slots, a non-finite value or key a row
sees, and head dims 64, 96 (padded to 128) and 128.  Controls: a chunk's state dropped from the
merge moves ``lse``; a counter not at zero merges nothing.  The speed choice picks the kernel for one sequence and
not for many; settings outside its scope raise with ``gluon=True``.  Skips without an sm_90 GPU.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.testing import assert_same_bits
from tpinv.testing.split_launch import assert_split_launch

from test_triton_attention import BF16, DEV, HKV, HQ, NAN, arange_pos, qkv, with_junk

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")

if torch.cuda.is_available():
    from tpinv.kernels import triton_attention as ta
    from tpinv.kernels import triton_attention_split as sp
    from tpinv.kernels.reference_attention import KV_BLOCK
    from tpinv.kernels.triton_attention import attention_forward_cuda


def _launch(q, k, v, pos, causal):
    D = q.shape[-1]
    DP = ta.padded_head_dim(D)
    return sp.SplitLaunch(q, k, v, pos, *ta.mask_args(None, q), HQ // HKV, causal, None,
                          ta.resolve_scale(None, D), False, ta.forward_config(q.dtype, DP), DP,
                          KV_BLOCK, ta.KV_CHUNK_BLOCKS)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_decode_gives_the_one_program_bits(dtype, causal):
    """Decode and a short chunked prefill through the Gluon kernel == one program per row tile,
    raw bytes; controls: a dropped chunk state moves lse, a counter not at 0 merges nothing."""
    T, T_cache = 3000, 3300
    chunk = KV_BLOCK * ta.KV_CHUNK_BLOCKS
    for B, S, d in ((1, 1, 128), (3, 1, 64), (2, 5, 128), (1, 3, 96)):
        q, k, v = qkv(B, S, T, seed=13 * B + S + d, dtype=dtype, d=d)
        k[:, 0, chunk + 7] = 4 * q[:, 0, -1]  # the last row's largest score: chunk 1
        pos = arange_pos(B, S, T - S)
        pos[0] -= 333  # batch rows at different positions
        # NaN in the cache's unused slots, which causal rows never see
        kc, vc = (with_junk(k, T_cache), with_junk(v, T_cache)) if causal else (k, v)
        one = attention_forward_cuda(q, kc, vc, pos, None, causal, None, None, split=False)
        par = attention_forward_cuda(q, kc, vc, pos, None, causal, None, None, gluon=True)
        for a, b in zip(one, par):
            assert_same_bits(b, a, f"gluon B={B} S={S} D={d}")
        launch = _launch(q, kc, vc, pos, causal)
        out, lse, acc_st, ml_st = assert_split_launch(launch, one, B * HKV, gluon=True)
        acc_st[:, 1] = 0.0
        ml_st[:, 1, :, 0] = float("-inf")
        ml_st[:, 1, :, 1] = 0.0
        sp.merge_chunks_cuda(launch, acc_st, ml_st, out, lse)
        assert (lse[:, 0, -1] < par[1][:, 0, -1] - 1.0).all(), "control: the dropped chunk is missed"


def test_gluon_decode_non_finite_values_and_keys():
    """A NaN value in a block some row sees in part, one in a slot no row sees, and an infinite
    key in a block every row sees: the one-program bytes (NaN where the forward puts NaN)."""
    q, k, v = qkv(2, 1, 1000, seed=5)
    pos = arange_pos(2, 1, 999)
    pos[1] -= 333
    v[0, 1, 995, 7] = NAN          # seen by batch row 0, in its last (partly seen) block
    v[1, 0, 990, 3] = NAN          # past batch row 1's position: never seen
    k[1, 1, 100, 5] = float("inf")  # seen by every row of batch row 1's kv head 1
    q[1, HQ // HKV, 0, 5] = 1.0     # so one of them scores +inf there (NaN out)
    one = attention_forward_cuda(q, k, v, pos, None, True, None, None, split=False)
    par = attention_forward_cuda(q, k, v, pos, None, True, None, None, gluon=True)
    assert torch.isnan(one[0][0]).any() and torch.isnan(one[0][1, HQ // HKV]).all()
    assert not torch.isnan(one[0][1, :HQ // HKV]).any(), "the unseen NaN stays out"
    for a, b in zip(one, par):
        assert_same_bits(b, a, "non-finite")


def test_gluon_decode_is_chosen_for_few_sequences():
    """The speed choice: the Gluon kernel where its programs fit one wave (one sequence), the
    Triton kernel past it (many sequences); both give the one-program bytes."""
    few = qkv(1, 1, 4096, seed=3) + (arange_pos(1, 1, 4095),)
    many = qkv(64, 1, 4096, seed=4) + (arange_pos(64, 1, 4095),)
    assert sp.decode_kernel_for(_launch(*few, True)) is not None
    assert sp.decode_kernel_for(_launch(*many, True)) is None
    for case in (few, many):
        one = attention_forward_cuda(*case, None, True, None, None, split=False)
        auto = attention_forward_cuda(*case, None, True, None, None)
        for a, b in zip(one, auto):
            assert_same_bits(b, a, "auto")


def test_gluon_decode_refuses_what_it_does_not_run():
    q, k, v = qkv(1, 1, 2000)
    pos = arange_pos(1, 1, 1999)
    with pytest.raises(ValueError, match="no window and no mask"):
        attention_forward_cuda(q, k, v, pos, None, True, 500, None, gluon=True)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        attention_forward_cuda(q.float(), k.float(), v.float(), pos, None, True, None, None,
                               gluon=True)
    q2, k2, v2 = qkv(1, 1, 2000, d=256)
    with pytest.raises(ValueError, match="multiple of 16 up to 128"):
        attention_forward_cuda(q2, k2, v2, pos, None, True, None, None, gluon=True)
    with pytest.raises(ValueError, match="needs split"):
        attention_forward_cuda(q, k, v, pos, None, True, None, None, split=False, gluon=True)
