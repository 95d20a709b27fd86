"""The Triton attention kernels under Triton's interpreter (CPU): parity and invariance.

Each check runs in its own interpreter process (:mod:`triton_interp`, one process per check),
so other test modules that imported triton for the GPU cannot change the mode.  fp16 and fp32
only (bf16 is not reliable in the interpreter), tiny shapes.  Parity with the CPU op is
``allclose`` (fp32: 1e-5; fp16: 4e-3 forward, 1e-2 gradients, from rounding ``p`` and
``dS`` to fp16 before their dots).  Bitwise checks here hold by construction only: the
masked and unmasked paths and strided inputs issue the same block operations on the same
values.  Batch and chunk invariance is not asserted here: the interpreter runs ``tl.dot``
through numpy, whose bits may depend on the block's row count (a property of numpy's BLAS,
not of the kernel), so those checks live in the GPU twin,
``tests/gpu/test_triton_attention.py`` (prefill vs chunked prefill and decode, ragged
batches with right and left padding, gradients alone vs in a padded batch).
"""
from __future__ import annotations

import importlib.util
import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from triton_interp import interpreted_test, main, seeded_checks  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits
from tpinv.testing.split_launch import assert_split_launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
FP16, FP32 = torch.float16, torch.float32
NAN = float("nan")
TOL = {FP32: (1e-5, 1e-5), FP16: (4e-3, 4e-3)}
GRAD_TOL = {FP32: (1e-4, 1e-5), FP16: (1e-2, 1e-2)}
#: (B, Hkv, g, S, T, D, mode): D=24 pads the head dim; T > S puts the queries last.
FWD_CASES = [(2, 2, 2, 70, 70, 16, "causal"), (1, 1, 1, 130, 130, 64, "window"),
             (2, 1, 2, 20, 90, 16, "mask"), (1, 2, 1, 33, 100, 24, "full"),
             (3, 1, 2, 9, 129, 64, "mask")]
BWD_CASES = [(2, 2, 2, 70, 70, 16, "causal"), (1, 1, 1, 100, 130, 64, "window"),
             (2, 1, 2, 20, 90, 16, "mask"), (1, 2, 1, 33, 100, 24, "full")]


# ------------------------------------------------------------------ checks (subprocess side)

def _setup():
    global fwd, bwd, attention_forward, attention_backward, cases
    import attention_cases as cases
    from tpinv.kernels.reference_attention import attention_forward
    from tpinv.kernels.reference_attention_bwd import attention_backward
    from tpinv.kernels.triton_attention import attention_forward_cuda as fwd
    from tpinv.kernels.triton_attention_bwd import attention_backward_cuda as bwd


def _close(a, b, tol, what):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol[0], atol=tol[1], msg=what,
                               equal_nan=False)


def _parity_case(case, dtype):
    """``(q, k, v, pos, mask, causal, window)`` of a parity case: queries last in the keys."""
    B, Hkv, g, S, T, D, mode = case
    q, k, v = cases.qkv(B, Hkv, g, S, T, D, dtype)
    mask = torch.rand(B, S, T) < 0.6 if mode == "mask" else None
    return q, k, v, cases.arange_pos(B, S, T - S), mask, mode != "full", 37 if mode == "window" else None


def check_forward_parity():
    for dtype in (FP32, FP16):
        for case in FWD_CASES:
            q, k, v, pos, mask, causal, window = _parity_case(case, dtype)
            mode = case[-1]
            if mask is not None:
                mask[:, 0] = False  # a row that sees nothing
            got = fwd(q, k, v, pos, mask, causal, window, None)
            ref = attention_forward(q, k, v, pos, mask, causal, window)
            _close(got[0], ref[0], TOL[dtype], f"out {dtype} {mode}")
            assert_same_bits(torch.isinf(got[1]), torch.isinf(ref[1]), str(mode))
            _close(got[1].nan_to_num(neginf=0), ref[1].nan_to_num(neginf=0), (1e-5, 1e-5), mode)


def check_backward_parity():
    for dtype in (FP32, FP16):
        for case in BWD_CASES:
            q, k, v, pos, mask, causal, window = _parity_case(case, dtype)
            mode = case[-1]
            out, lse = attention_forward(q, k, v, pos, mask, causal, window)
            dout = cases.randn(*q.shape, dtype=dtype)
            dlse = cases.randn(*lse.shape) if mode != "causal" else None
            got = bwd(dout, dlse, q, k, v, out, lse, pos, mask, causal, window, None)
            ref = attention_backward(dout, dlse, q, k, v, out, lse, pos, mask, causal, window)
            for name, a, b in zip("qkv", got, ref):
                _close(a, b, GRAD_TOL[dtype], f"d{name} {dtype} {mode}")


def check_paths_and_strides():
    """All-True mask / huge window (masked path) == no mask (unmasked path); strided inputs."""
    B, Hkv, g, S, D = 2, 1, 2, 130, 16
    q, k, v = cases.qkv(B, Hkv, g, S, S, D, FP16)
    pos = cases.arange_pos(B, S)
    ref = fwd(q, k, v, pos, None, True, None, None)
    ones = torch.ones(B, S, S, dtype=torch.bool)
    for mask, window in ((ones, None), (None, 10 ** 6), (ones, 10 ** 6)):
        got = fwd(q, k, v, pos, mask, True, window, None)
        for a, b in zip(got, ref):
            assert_same_bits(a, b, str((mask is None, window)))
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    got = fwd(*strided, pos, None, True, None, None)
    for a, b in zip(got, ref):
        assert_same_bits(a, b, "strided inputs")
    dout = cases.randn(*q.shape, dtype=FP16)
    g_ref = bwd(dout, None, q, k, v, *ref, pos, None, True, None, None)
    g_zero = bwd(dout, torch.zeros_like(ref[1]), q, k, v, *ref, pos, None, True, None, None)
    g_mask = bwd(dout, None, q, k, v, *ref, pos, ones, True, 10 ** 6, None)
    g_str = bwd(dout.transpose(1, 2).contiguous().transpose(1, 2), None, *strided, *ref, pos,
                None, True, None, None)
    for other in (g_zero, g_mask, g_str):
        for a, b in zip(other, g_ref):
            assert_same_bits(a, b, 'a')


def check_edge_cases():
    q, k, v = cases.qkv(2, 1, 2, 5, 70, 16, FP32)
    out, lse = fwd(q[:, :, :0], k, v, torch.zeros(2, 0, dtype=torch.int64), None, True, None, None)
    assert out.shape == (2, 2, 0, 16) and lse.shape == (2, 2, 0)
    out, lse = fwd(q, k[:, :, :0], v[:, :, :0], cases.arange_pos(2, 5), None, True, None, None)
    assert not out.any() and torch.isneginf(lse).all()
    dq, dk, dv = bwd(q, None, q, k[:, :, :0], v[:, :, :0], out, lse, cases.arange_pos(2, 5), None,
                     True, None, None)
    assert not dq.any() and dk.shape == (2, 1, 0, 16)
    out, lse = fwd(q, k, v, cases.arange_pos(2, 5, start=-9), None, True, None, None)
    assert not out.any() and torch.isneginf(lse).all()
    dq, dk, dv = bwd(q, None, q, k, v, out, lse, cases.arange_pos(2, 5, start=-9), None, True,
                     None, None)
    assert not (dq.any() or dk.any() or dv.any())
    q, k, v = cases.qkv(1, 1, 2, 40, 40, 16, FP16)  # a NaN value reaches exactly its viewers
    v[:, :, 20, 3] = NAN
    out, _ = fwd(q, k, v, cases.arange_pos(1, 40), None, True, None, None)
    assert not out[:, :, :20].isnan().any() and out[:, :, 20:].isnan().any(-1).all()
    out, _ = fwd(q, k, v, cases.arange_pos(1, 40), None, True, 5, None)
    assert out[:, :, 20:25].isnan().any(-1).all() and not out[:, :, 25:].isnan().any()
    q, k, v = cases.qkv(1, 1, 2, 40, 40, 16, FP16)  # a NaN key makes its viewers NaN, as in PyTorch
    k[:, :, 20, 3] = NAN
    out, lse = fwd(q, k, v, cases.arange_pos(1, 40), None, True, None, None)
    assert not out[:, :, :20].isnan().any() and out[:, :, 20:].isnan().all() and lse[:, :, 20:].isnan().all()
    try:
        fwd(*cases.qkv(1, 1, 1, 3, 3, 300, FP32), cases.arange_pos(1, 3), None, True, None, None)
    except ValueError as e:
        assert "head dim" in str(e)
    else:
        raise AssertionError("D=300 must be refused")


def _split_case(S, T, dtype, mode, seed):
    """A few query rows (the last ``S`` positions of ``T`` keys) over keys of several chunks,
    with the last row's largest score in key slot ``T // 3``."""
    torch.manual_seed(seed)
    q, k, v = cases.qkv(2, 1, 2, S, T, 16, dtype)
    k[:, 0, T // 3] = 3 * q[:, 1, -1]
    pos = cases.arange_pos(2, S, T - S)
    pos[1] -= 40  # batch rows at different positions
    mask = torch.rand(2, S, T) < 0.7 if mode == "mask" else None
    if mask is not None:
        mask[:, :, 600:1100] = False  # a chunk no row sees
    return q, k, v, pos, mask, mode != "full", 700 if mode == "window" else None


def check_split_chunks():
    """Chunks in parallel (decode, a short chunked prefill) == one program per row tile, raw
    bytes, out and lse, launches in turn sharing counters that each leaves at zero; controls:
    with one chunk's state dropped the merge gives other bytes; a counter not at zero merges
    nothing."""
    from tpinv.kernels import triton_attention as ta
    from tpinv.kernels import triton_attention_split as sp
    from tpinv.kernels.reference_attention import KV_BLOCK
    table = ta.KV_CHUNK_BLOCKS
    for cb in (table, 2):
        ta.KV_CHUNK_BLOCKS = cb
        for dtype in (FP16, FP32):
            for S, T, mode in ((1, 1300, "causal"), (3, 1300, "window"), (2, 1250, "mask"),
                               (1, 1100, "full")):
                q, k, v, pos, mask, causal, window = _split_case(S, T, dtype, mode, cb + S)
                if mode == "causal":
                    v[0, 0, 700, 5] = NAN  # reaches the rows that see slot 700 only
                assert sp.use_split(2, 1, S * 2, ta.forward_config(dtype, 16).block_m, T,
                                    KV_BLOCK, cb, 16)
                one = fwd(q, k, v, pos, mask, causal, window, None, split=False)
                par = fwd(q, k, v, pos, mask, causal, window, None, split=True)
                auto = fwd(q, k, v, pos, mask, causal, window, None)
                for a, b, c in zip(one, par, auto):
                    assert_same_bits(b, a, f"split {cb} {dtype} {mode}")
                    assert_same_bits(c, a, f"auto {cb} {dtype} {mode}")
                ref = attention_forward(q, k, v, pos, mask, causal, window)
                torch.testing.assert_close(par[0].float(), ref[0].float(), rtol=TOL[dtype][0],
                                           atol=TOL[dtype][1], equal_nan=True, msg=mode)
                if mode != "causal":
                    continue
                assert torch.isnan(par[0][0]).any() and not torch.isnan(par[0][1]).any()
                launch = sp.SplitLaunch(q, k, v, pos, *ta.mask_args(None, q), 2, True, None,
                                        ta.resolve_scale(None, 16), False,
                                        ta.forward_config(dtype, 16), 16, KV_BLOCK, cb)
                out, lse, acc_st, ml_st = assert_split_launch(launch, par, 2)
                dropped = (T // 3) // (KV_BLOCK * cb)  # the chunk of the last row's largest score
                acc_st[1, dropped] = 0.0
                ml_st[1, dropped, :, 0] = float("-inf")
                ml_st[1, dropped, :, 1] = 0.0
                sp.merge_chunks_cuda(launch, acc_st, ml_st, out, lse)
                assert_same_bits(out[0], par[0][0], "the other batch row")
                assert lse[1, 1, -1] < par[1][1, 1, -1] - 1.0, "control: a dropped chunk is missed"
    ta.KV_CHUNK_BLOCKS = table


def check_tma_loads():
    """Tiles read through TMA descriptors (K/V blocks; a kv head's interleaved q/dO rows read as
    ``[B, S, Hkv, g, D]``) == pointer loads, raw bytes, forward and backward, head-major and
    ``[B, S, H, D]``-strided q and dO, a padded head dim (24 of 32).  ``tma=True`` proves the
    descriptor path ran (it raises where it cannot: fp32; the dK/dV kernel with a window or
    mask).  Without host descriptors (Triton < 3.4) no descriptor is built.  Controls (the cases
    without a mask): a changed value slot moves ``out``, a changed key slot moves its ``dK``."""
    from tpinv.kernels import triton_attention_tma as tm
    if tm.TensorDescriptor is None:
        q, k, v = cases.qkv(1, 1, 2, 8, 8, 16, FP16)
        assert tm.kv_descriptors(k, v, 64, 16) is None
        return
    for B, Hkv, g, S, T, D, mode in ((2, 2, 2, 70, 70, 24, "causal"), (1, 1, 4, 40, 130, 16, "window"),
                                     (2, 1, 2, 20, 90, 16, "mask"), (1, 2, 1, 33, 100, 24, "full")):
        q, k, v, pos, mask, causal, window = _parity_case((B, Hkv, g, S, T, D, mode), FP16)
        args = (pos, mask, causal, window, None)
        want = fwd(q, k, v, *args, split=False, tma=False)
        dout = cases.randn(*q.shape, dtype=FP16)
        gwant = bwd(dout, None, q, k, v, *want, *args, tma=False)
        dkdv_tma = window is None and mask is None
        for qq, dd in ((q, dout), (_bshd(q), _bshd(dout))):
            got = fwd(qq, k, v, *args, split=False, tma=True)
            for a, b in zip(got, want):
                assert_same_bits(a.contiguous(), b, f"forward {mode}")
            ggot = bwd(dd, None, qq, k, v, *want, *args, tma=True if dkdv_tma else None)
            for a, b in zip(ggot, gwant):
                assert_same_bits(a.contiguous(), b, f"backward {mode}")
        if not dkdv_tma:
            with pytest.raises(ValueError, match="window or mask"):
                bwd(dout, None, q, k, v, *want, *args, tma=True)
        if mask is None:                 # the last query of batch row 0 sees its own slot
            v2 = v.clone()
            v2[0, 0, int(pos[0, -1])] += 1.0
            moved = fwd(q, k, v2, *args, split=False, tma=True)
            assert_bits_differ(moved[0][0, 0, -1], want[0][0, 0, -1], "control: a changed value moved nothing")
            slot = int(pos[0, -1])
            k2 = k.clone()
            k2[0, 0, slot] += 1.0
            gmoved = bwd(dout, None, q, k2, v, *want, *args, tma=True if dkdv_tma else None)
            assert_bits_differ(gmoved[1][0, 0, slot], gwant[1][0, 0, slot], "control: a changed key moved no dK")
    q, k, v = cases.qkv(1, 1, 2, 8, 8, 16, FP32)
    with pytest.raises(ValueError, match="TMA"):
        fwd(q, k, v, cases.arange_pos(1, 8), tma=True)


def _bshd(x):
    return x.transpose(1, 2).contiguous().transpose(1, 2)


CHECKS = seeded_checks(dict(globals()), _setup)
test_interpreter = interpreted_test(__file__, CHECKS, process_per_check=True)

if __name__ == "__main__":
    main(CHECKS)
