"""The CUDA contract matmul: same bits at any batch size, N slice, K split and launch shape.

Every invariance check is bitwise (``assert_same_bits``: shape, dtype and raw bytes) and has a negative control beside it:
the vanilla path (cuBLAS ``torch.matmul``, a sum of K-split partials, a different leaf
tree) shows a difference on the same kind of inputs.  Every test here needs CUDA; the
tile-table tests that run anywhere are in tests/unit/test_tiles.py.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tpinv.core.contract import InvarianceError, tree_combine
from tpinv.kernels import tiles

triton = pytest.importorskip("triton")
from tpinv.kernels.matmul_route import matmul_cuda, matmul_partial_cuda  # noqa: E402
from tpinv.kernels.triton_matmul import launch_contract  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits, same_bits

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda"
ROW_MS = (1, 2, 3, 7, 64, 1000, 4096)
#: parity with the fp64 product, per dtype (relative Frobenius error)
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _rand(*shape, dtype=torch.bfloat16):
    return (torch.randn(*shape, device=DEV) / shape[-1] ** 0.25).to(dtype)


def _rel_err(out, x, w):
    ref = x.double() @ w.double().T
    return ((out.double() - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------- input checks on the GPU
# (the tile-table tests and the CPU-tensor refusal run on any machine: tests/unit/test_tiles.py)

@cuda
def test_input_errors_name_the_expected_shape():
    x, w = torch.zeros(3, 64, device=DEV), torch.zeros(5, 64, device=DEV)
    with pytest.raises(ValueError, match=r"x \[\.\.\., K\] and w \[N, K\]"):
        matmul_cuda(x, torch.zeros(5, 32, device=DEV), 8)
    with pytest.raises(InvarianceError, match="not divisible"):
        matmul_cuda(torch.zeros(3, 60, device=DEV), torch.zeros(5, 60, device=DEV), 8)
    with pytest.raises(InvarianceError, match="power of two"):
        matmul_cuda(x, w, 3)
    with pytest.raises(TypeError, match="must equal x dtype"):
        matmul_cuda(x, w.half(), 8)


@cuda
def test_inputs_checked_once_per_call_signature(monkeypatch):
    """The kernel checks a call signature's inputs on its first call; once its route is kept, a call
    with the same shapes, strides, dtypes, alignment, device and leaves (every check is a function
    of them) is not checked again.  Control: a call of another signature is checked, and bad
    inputs still raise after good ones of the same shapes ran."""
    from tpinv.kernels import matmul_route as route
    calls = []
    check = route.check_inputs
    monkeypatch.setattr(route, "_ROUTES", {})
    monkeypatch.setattr(route, "check_inputs", lambda *a: (calls.append(a[0].shape), check(*a)))
    x, w = _rand(37, 64), _rand(48, 64)
    first = matmul_cuda(x, w, 1)
    assert len(calls) == 1
    assert_same_bits(matmul_cuda(x.clone(), w, 1), first, "a kept route's launch")
    assert len(calls) == 1, "a kept signature was checked again"
    matmul_cuda(_rand(38, 64), w, 1)
    assert len(calls) == 2, "control: a new signature was not checked"
    with pytest.raises(TypeError, match="must equal x dtype"):
        matmul_cuda(x, w.float(), 1)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        matmul_cuda(x, w.cpu(), 1)
    with pytest.raises(ValueError, match=r"x \[\.\.\., K\] and w \[N, K\]"):
        matmul_cuda(x, _rand(48, 32), 1)


# ---------------------------------------------------------------- batch invariance

@cuda
@pytest.mark.parametrize("leaves", [1, 8])
@pytest.mark.parametrize("k", [1024, 1000])  # 1000: leaf 125, zero-padded pointer path
def test_row_alone_equals_row_in_batch(leaves, k):
    n = 777
    w = _rand(n, k)
    big = _rand(max(ROW_MS), k)
    full = matmul_cuda(big, w, leaves)
    for m in ROW_MS:
        x = big[:m]
        out = matmul_cuda(x, w, leaves)
        assert_same_bits(out, full[:m], f"M={m} rows differ from M={max(ROW_MS)} rows")
        r = int(torch.randint(m, ()))
        assert_same_bits(matmul_cuda(x[r:r + 1], w, leaves)[0], out[r], f"M={m} row {r}")


@cuda
def test_negative_control_cublas_rows_depend_on_batch():
    w = _rand(4096, 4096)
    x = _rand(512, 4096)
    assert_bits_differ(torch.matmul(x[:1], w.T), torch.matmul(x, w.T)[:1], 'torch.matmul(x[:1], w.T)')


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_row_invariance_other_dtypes(dtype):
    w = _rand(300, 512, dtype=dtype)
    x = _rand(1000, 512, dtype=dtype)
    full = matmul_partial_cuda(x, w, 8)
    for m in (1, 7, 64, 1000):
        assert_same_bits(matmul_partial_cuda(x[:m], w, 8), full[:m], 'matmul_partial_cuda(x[:m], w, 8)')


# ---------------------------------------------------------------- N slices

@cuda
@pytest.mark.parametrize("leaves", [1, 8])
def test_n_slice_equals_slice_of_full(leaves):
    k, n = 2048, 1536
    w = _rand(n, k)
    for m in (5, 300):
        x = _rand(m, k)
        full = matmul_cuda(x, w, leaves)
        for a, b in ((0, 64), (8, 1000), (776, 1536), (1000, 1001)):
            assert_same_bits(matmul_cuda(x, w[a:b], leaves), full[:, a:b], str((m, a, b)))


@cuda
def test_negative_control_cublas_n_slice_differs():
    differs = False
    for m, k in ((16, 8192), (64, 8192), (1, 16384)):
        w = _rand(8192, k)
        x = _rand(m, k)
        differs |= not same_bits(torch.matmul(x, w[:128].T), torch.matmul(x, w.T)[:, :128])
    assert differs


# ---------------------------------------------------------------- K split (TP) invariance

@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [4096, 1000])
def test_k_split_tree_equals_full(dtype, k):
    m, n, leaves = 37, 520, 8
    x, w = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype)
    full = matmul_partial_cuda(x, w, leaves)
    for c in (1, 2, 4, 8):
        ks = k // c
        parts = [matmul_partial_cuda(x[:, i * ks:(i + 1) * ks], w[:, i * ks:(i + 1) * ks],
                                     leaves // c) for i in range(c)]
        assert_same_bits(tree_combine(torch.stack(parts, -1)), full, f"C={c}")
    assert_same_bits(matmul_cuda(x, w, leaves), full.to(dtype), 'matmul_cuda(x, w, leaves)')


@cuda
def test_negative_control_cublas_k_split_sum_differs():
    m, n, k = 37, 520, 4096
    x, w = _rand(m, k), _rand(n, k)
    full = torch.matmul(x, w.T)
    for c in (2, 4, 8):
        ks = k // c
        parts = [torch.matmul(x[:, i * ks:(i + 1) * ks], w[:, i * ks:(i + 1) * ks].T).float()
                 for i in range(c)]
        assert_bits_differ(sum(parts).to(x.dtype), full, f"C={c}")


# ---------------------------------------------------------------- launch shapes

@cuda
@pytest.mark.parametrize("leaves", [1, 2, 8])
def test_every_candidate_config_gives_the_same_bits(leaves):
    k, n = 2048, 392
    w = _rand(n, k)
    x = _rand(1000, k)
    for m in (1, 7, 64, 1000):
        ref = launch_contract(x[:m], w, leaves, torch.float32, tiles.launch_config(m, leaves))
        for cfg in tiles.CANDIDATE_CONFIGS:
            out = launch_contract(x[:m], w, leaves, torch.float32, cfg)
            assert_same_bits(out, ref, f"M={m} {cfg.name()}")
        for cfg in tiles.CANDIDATE_CONFIGS[:3]:  # pointer loads instead of descriptors
            out = launch_contract(x[:m], w, leaves, torch.float32, cfg, allow_tma=False)
            assert_same_bits(out, ref, f"M={m} {cfg.name()} pointer loads")


@cuda
def test_negative_control_another_leaf_tree_differs():
    x, w = _rand(64, 2048), _rand(392, 2048)
    assert_bits_differ(matmul_partial_cuda(x, w, 8), matmul_partial_cuda(x, w, 4), 'matmul_partial_cuda(x, w, 8)')


@cuda
def test_strided_and_transposed_weight_views():
    k, n = 1024, 320
    x = _rand(9, 2, k)
    w = _rand(n, k)
    ref = matmul_cuda(x, w, 8)
    assert ref.shape == (9, 2, n)
    w_t = w.T.contiguous().T                      # [N, K] view of a [K, N] tensor
    w_s = torch.empty(n, 2 * k, device=DEV, dtype=w.dtype)[:, ::2].copy_(w)  # k stride 2
    x_s = torch.empty(9, 2, 2 * k, device=DEV, dtype=x.dtype)[..., ::2].copy_(x)
    for ww, xx in ((w_t, x), (w_s, x), (w, x_s)):
        assert_same_bits(matmul_cuda(xx, ww, 8), ref, 'matmul_cuda(xx, ww, 8)')


@cuda
@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 300), n=st.integers(1, 300), log2_leaves=st.integers(0, 3),
       leaf_len=st.sampled_from([1, 8, 16, 24, 64, 100, 256]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_shape_property_rows_and_k_split(m, n, log2_leaves, leaf_len, dtype):
    leaves = 1 << log2_leaves
    k = leaves * leaf_len
    x, w = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype)
    full = matmul_partial_cuda(x, w, leaves)
    r = int(torch.randint(m, ()))
    assert_same_bits(matmul_partial_cuda(x[r:r + 1], w, leaves), full[r:r + 1],
                     'matmul_partial_cuda(x[r:r + 1], w, leaves)')
    half = k // 2
    if leaves >= 2:
        parts = [matmul_partial_cuda(x[:, :half], w[:, :half], leaves // 2),
                 matmul_partial_cuda(x[:, half:], w[:, half:], leaves // 2)]
        assert_same_bits(parts[0] + parts[1], full, 'parts[0] + parts[1]')
    assert _rel_err(full, x, w) < REL_TOL[torch.float32] * 10


# ---------------------------------------------------------------- accuracy

@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_accuracy_matches_cublas(dtype):
    m, n, k = 256, 1024, 4096
    x, w = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype)
    ours = _rel_err(matmul_cuda(x, w, 8), x, w)
    ours_fp32 = _rel_err(matmul_partial_cuda(x, w, 8), x, w)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        theirs = _rel_err(torch.matmul(x, w.T), x, w)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    print(f"{dtype}: rel err ours {ours:.3e} (fp32 partial {ours_fp32:.3e}) cuBLAS {theirs:.3e}")
    assert ours < REL_TOL[dtype] and ours <= 1.25 * theirs + 1e-7
    assert ours_fp32 <= ours + 1e-12


@cuda
def test_m_zero_and_every_element_written():
    w = _rand(130, 256)
    assert matmul_cuda(_rand(0, 256), w, 8).shape == (0, 130)
    x = _rand(65, 256)
    out = matmul_partial_cuda(x, w, 8)
    assert torch.isfinite(out).all()
    assert _rel_err(out, x, w) < 1e-5
