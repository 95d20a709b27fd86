"""tpinv.ops.linear: matmul_partial / matmul / tree_sum keep the contract's bits everywhere.

Invariance is asserted bitwise (``assert_same_bits``: shape, dtype and raw bytes).  Each
invariance test has a negative control beside it that changes the summation order by
construction (another leaf count, or rank partials added left to right) and so gives
different bits in the same comparison.
"""
from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpinv.testing import assert_bits_differ, assert_same_bits, num_threads, same_bits
from tpinv.core.contract import DEFAULT_LEAVES, InvarianceError, tree_combine, tree_combine_list
from tpinv.kernels import reference_matmul
from tpinv.kernels.reference_tree import leaf_tree_sum
from tpinv.ops import matmul, matmul_partial, tree_sum
from tpinv.ops.linear import matmul_op, matmul_partial_op, tree_sum_op
from tpinv.ops.registry import cuda_kernel, has_cuda_kernel
from tpinv.testing import record_ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Parity with an fp64 matmul of the same (upcast) inputs: max |err| / max |ref|.
# The fp32 partial only rounds in fp32; matmul rounds once more to the input dtype.
PARTIAL_TOL = 1e-5
MATMUL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rand(*shape, dtype=torch.float32, seed=None):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(*shape, generator=gen).to(dtype)


def blas(x, w):
    return torch.matmul(x, w.t())


def rel_err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


# ---- the definition -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 8), (3, 5, 24), (9, 11, 56), (13, 7, 8 * 64), (40, 33, 8 * 9)])
@pytest.mark.parametrize("leaves", [1, 2, 8])
def test_equals_definition(dtype, m, n, k, leaves):
    x, w = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype)
    want = leaf_tree_sum(x.float()[..., None, :] * w.float()[None, :, :], leaves)
    assert_same_bits(matmul_partial(x, w, leaves), want, 'matmul_partial(x, w, leaves)')
    for chunk in (1, 7, 300):       # chunk edges, zero padding of M and N, both layouts
        assert_same_bits(reference_matmul.matmul_partial(x, w, leaves, chunk_elements=chunk), want,
                         'reference_matmul.matmul_partial(x, w, leaves, c...')


@pytest.mark.parametrize("rows", [1, reference_matmul.K_OUTER_MIN_ROWS + 1])   # both layouts
def test_definition_negative_zero_and_padding(rows):
    # A leaf of 3 is padded to 4 with +0.0, so a leaf of -0.0 products sums to +0.0;
    # a leaf of 4 has no padding and sums to -0.0.
    w = torch.ones(3, 32)
    for k, negative in ((24, False), (32, True)):
        x = torch.full((rows, k), -0.0)
        want = leaf_tree_sum(x[..., None, :] * w[None, :, :k], 8)
        for chunk in (1, 1 << 18):
            got = reference_matmul.matmul_partial(x, w[:, :k], 8, chunk_elements=chunk)
            assert_same_bits(got, want, 'got')
            assert bool(torch.signbit(got).all()) == negative


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 20), k8=st.integers(1, 24),
       leaves=st.sampled_from([1, 2, 4, 8]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_shapes_property(m, n, k8, leaves, dtype, seed):
    k = 8 * k8
    x, w = rand(m, k, dtype=dtype, seed=seed), rand(n, k, dtype=dtype, seed=seed + 1)
    full = matmul_partial(x, w, leaves)
    assert_same_bits(full, reference_matmul.matmul_partial_reference(x, w, leaves), 'full')
    row = seed % m
    assert_same_bits(matmul_partial(x[row:row + 1], w, leaves), full[row:row + 1],
                     'matmul_partial(x[row:row + 1], w, leaves)')


# ---- batch composition ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_batch(dtype):
    k, n = 8 * 13, 24
    x, w = rand(1000, k, dtype=dtype), rand(n, k, dtype=dtype)
    full = matmul_partial(x, w)
    for m in (1, 2, 3, 7, 64, 1000):
        assert_same_bits(matmul_partial(x[:m], w), full[:m], str(m))
    for row in (0, 499, 999):
        assert_same_bits(matmul_partial(x[row], w), full[row], 'matmul_partial(x[row], w)')
    assert_same_bits(matmul(x[5:12], w), full[5:12].to(dtype), 'matmul(x[5:12], w)')


def test_rows_control_summation_order():
    """Control for the row tests, by construction: the same rows summed in another order
    (4 leaves instead of 8) give other bits, so a kernel whose order followed the batch would
    fail them.  (BLAS often depends on the batch too, but that is the library's choice on a
    given machine, so it is not asserted here.)"""
    x, w = rand(64, 8 * 13), rand(24, 8 * 13)
    full = matmul_partial(x, w)
    for m in (1, 2, 3, 7, 64):
        assert_bits_differ(matmul_partial(x[:m], w, 4), full[:m], f"4-leaf vs 8-leaf rows, m={m}")
    assert_same_bits(matmul_partial(x[:3], w), matmul_partial(x[:20], w)[:3], "matmul_partial rows of 3 vs 20")


def test_n_slices_equal_slice_of_full():
    x, w = rand(24, 8 * 40), rand(400, 8 * 40)
    full = matmul_partial(x, w)
    for n0, n1 in [(0, 1), (3, 10), (5, 133), (100, 357), (399, 400)]:
        assert_same_bits(matmul_partial(x, w[n0:n1]), full[:, n0:n1], 'matmul_partial(x, w[n0:n1])')
        assert_same_bits(matmul_partial(x[:1], w[n0:n1]), full[:1, n0:n1], 'matmul_partial(x[:1], w[n0:n1])')


def test_n_slices_control_summation_order():
    # By construction: the same slices summed over 2 leaves instead of 8 give other bits.
    x, w = rand(24, 8 * 40), rand(400, 8 * 40)
    full = matmul_partial(x, w)
    assert_bits_differ(matmul_partial(x, w[5:133], 2), full[:, 5:133], "2-leaf vs 8-leaf N-slice")
    assert_bits_differ(matmul_partial(x[:1], w[3:10], 2), full[:1, 3:10], "2-leaf vs 8-leaf N-slice of one row")


# ---- K split over a group of C ranks --------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_k_split_partials_combine_to_full(dtype, group):
    k = 8 * 48
    x, w = rand(17, k, dtype=dtype), rand(29, k, dtype=dtype)
    per = k // group
    parts = [matmul_partial(x[:, r * per:(r + 1) * per], w[:, r * per:(r + 1) * per], DEFAULT_LEAVES // group)
             for r in range(group)]
    full = matmul_partial(x, w, DEFAULT_LEAVES)
    assert_same_bits(tree_combine_list(parts), full, 'tree_combine_list(parts)')
    assert_same_bits(tree_combine(torch.stack(parts, dim=-1)), full, 'tree_combine(torch.stack(parts, dim=-1))')


def test_k_split_control_blas_partials():
    # Vanilla TP: each rank's BLAS partial, summed left to right.  (BLAS itself blocks K,
    # so the C=2 sum can coincide with the full product; the finer splits do not.)
    x, w = rand(17, 1024), rand(29, 1024)
    full = blas(x, w)
    differs = []
    for group in (2, 4, 8):
        per = 1024 // group
        total = blas(x[:, :per], w[:, :per])
        for r in range(1, group):
            total = total + blas(x[:, r * per:(r + 1) * per], w[:, r * per:(r + 1) * per])
        differs.append(not same_bits(total, full))
    assert differs[1] and differs[2]


# ---- threads and layout ---------------------------------------------------------------

def thread_split_k(x, w):
    """The control: a matmul that cuts K into one piece per thread and adds the pieces' BLAS
    products in order (as split-K CPU GEMMs do), so its order follows the thread count on
    every machine -- whether a BLAS's own bits move with threads depends on the BLAS."""
    pieces = torch.get_num_threads()
    per = -(-x.shape[1] // pieces)
    total = blas(x[:, :per], w[:, :per])
    for k0 in range(per, x.shape[1], per):
        total = total + blas(x[:, k0:k0 + per], w[:, k0:k0 + per])
    return total


def test_threads_do_not_change_bits():
    x, w = rand(64, 1024), rand(256, 1024)
    # The default K-outer chunk grows with the thread count: 1 and 2 threads split the
    # outputs into different chunks, so the comparison below exercises a different layout.
    per_chunk = {t: reference_matmul.K_OUTER_CHUNK_PER_THREAD * t // 1024 for t in (1, 2)}
    assert per_chunk[1] < per_chunk[2] < 64 * 256
    with num_threads(1):
        one = matmul_partial(x, w)
        blas_one = thread_split_k(x, w)
    with num_threads(2):
        two = matmul_partial(x, w)
        blas_two = thread_split_k(x, w)
    assert_same_bits(one, two, 'result')
    assert_bits_differ(blas_one, blas_two, "control")   # control: K split by the thread count


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [3, reference_matmul.K_OUTER_MIN_ROWS + 5])     # both layouts
def test_layout_does_not_change_bits(dtype, m):
    x, w = rand(m, 8 * 40, dtype=dtype), rand(300, 8 * 40, dtype=dtype)
    want = matmul_partial(x, w)
    w_colmajor = w.t().contiguous().t()
    x_colmajor = x.t().contiguous().t()
    w_strided = torch.stack([w, w], dim=-1)[..., 0]
    x_batched = x.reshape(m, 1, -1).expand(m, 2, -1).transpose(0, 1)    # [2, m, K] stride-0 view
    assert_same_bits(matmul_partial(x, w_colmajor), want, 'matmul_partial(x, w_colmajor)')
    assert_same_bits(matmul_partial(x_colmajor, w), want, 'matmul_partial(x_colmajor, w)')
    assert_same_bits(matmul_partial(x, w_strided), want, 'matmul_partial(x, w_strided)')
    assert_same_bits(matmul_partial(x_batched, w), want.expand(2, m, -1), 'matmul_partial(x_batched, w)')


def test_layout_control_summation_order():
    # By construction: the layouts above, summed over 4 leaves instead of 8, give other bits.
    x, w = rand(3, 8 * 40), rand(300, 8 * 40)
    assert_bits_differ(matmul_partial(x, w.t().contiguous().t(), 4), matmul_partial(x, w), "4 vs 8 leaves")


# ---- parity ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_parity_with_fp64(dtype):
    x, w = rand(37, 8 * 96, dtype=dtype), rand(45, 8 * 96, dtype=dtype)
    want = x.double() @ w.double().t()
    assert rel_err(matmul_partial(x, w), want) < PARTIAL_TOL
    y = matmul(x, w)
    assert y.dtype == dtype
    assert rel_err(y, want) < MATMUL_TOL[dtype]


def test_batched_input_shape():
    x, w = rand(2, 3, 5, 16), rand(7, 16)
    out = matmul_partial(x, w)
    assert out.shape == (2, 3, 5, 7) and out.dtype == torch.float32
    assert_same_bits(out.reshape(-1, 7), matmul_partial(x.reshape(-1, 16), w), 'out.reshape(-1, 7)')
    assert matmul_partial(rand(0, 16), w).shape == (0, 7)


# ---- autograd -------------------------------------------------------------------------

def fwd_bwd(x, w, dy, leaves=DEFAULT_LEAVES, grad_leaves=DEFAULT_LEAVES):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = matmul(x, w, leaves, grad_leaves)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_grads_follow_the_contract(dtype):
    x, w, dy = rand(2, 9, 48, dtype=dtype), rand(40, 48, dtype=dtype), rand(2, 9, 40, dtype=dtype)
    _, dx, dw = fwd_bwd(x, w, dy)
    assert_same_bits(dx, matmul_partial(dy, w.t(), DEFAULT_LEAVES).to(dtype), 'dx')
    assert_same_bits(dw, matmul_partial(dy.reshape(-1, 40).t(), x.reshape(-1, 48).t(), 1).to(dtype), 'dw')


def test_input_grad_rows_do_not_depend_on_batch():
    x, w, dy = rand(300, 64), rand(80, 64), rand(300, 80)
    _, dx, dw = fwd_bwd(x, w, dy)
    for row in (0, 17, 299):
        _, dx_row, _ = fwd_bwd(x[row:row + 1], w, dy[row:row + 1])
        assert_same_bits(dx_row, dx[row:row + 1], 'dx_row')
    # dW: the token chain's zero padding makes trailing zero-gradient tokens exact no-ops.
    pad_x = torch.cat([x, rand(212, 64).abs()])
    pad_dy = torch.cat([dy, torch.zeros(212, 80)])
    _, _, dw_padded = fwd_bwd(pad_x, w, pad_dy)
    assert_same_bits(dw_padded, dw, 'dw_padded')


def test_input_grad_control_torch_autograd():
    x, w, dy = rand(300, 1024), rand(256, 1024), rand(300, 256)

    def torch_grads(x, dy):
        x = x.clone().requires_grad_(True)
        wt = w.clone().requires_grad_(True)
        (x @ wt.t()).backward(dy)
        return x.grad, wt.grad

    dx, dw = torch_grads(x, dy)
    assert any(not same_bits(torch_grads(x[r:r + 1], dy[r:r + 1])[0], dx[r:r + 1]) for r in (0, 17, 299))
    pad = torch_grads(torch.cat([x, rand(212, 1024).abs()]), torch.cat([dy, torch.zeros(212, 256)]))
    assert_bits_differ(pad[1], dw, 'pad[1]')


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_input_grad_split_over_n(group):
    # Column parallelism splits N: each rank's dX partial over its N-slice, tree-combined.
    x, w, dy = rand(11, 32), rand(8 * 12, 32), rand(11, 8 * 12)
    _, dx, _ = fwd_bwd(x, w, dy)
    per = w.shape[0] // group
    parts = [matmul_partial(dy[:, r * per:(r + 1) * per], w[r * per:(r + 1) * per].t(), DEFAULT_LEAVES // group)
             for r in range(group)]
    combined = tree_combine_list(parts)
    assert_same_bits(combined, matmul_partial(dy, w.t(), DEFAULT_LEAVES), 'combined')
    assert_same_bits(combined, dx, 'combined')


def test_input_grad_split_control_blas():
    w, dy = rand(1024, 32), rand(11, 1024)
    full = blas(dy, w.t())
    halves = blas(dy[:, :512], w[:512].t()) + blas(dy[:, 512:], w[512:].t())
    quarters = [blas(dy[:, r * 256:(r + 1) * 256], w[r * 256:(r + 1) * 256].t()) for r in range(4)]
    left_to_right = ((quarters[0] + quarters[1]) + quarters[2]) + quarters[3]
    assert not same_bits(halves, full) or not same_bits(left_to_right, full)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_parity_with_torch(dtype):
    x, w, dy = rand(23, 8 * 20, dtype=dtype), rand(8 * 5, 8 * 20, dtype=dtype), rand(23, 8 * 5, dtype=dtype)
    _, dx, dw = fwd_bwd(x, w, dy)
    xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
    (xd @ wd.t()).backward(dy.double())
    assert rel_err(dx, xd.grad) < MATMUL_TOL[dtype]
    assert rel_err(dw, wd.grad) < MATMUL_TOL[dtype]


def test_invariant_path_runs():
    x, w = rand(4, 16, dtype=torch.bfloat16).requires_grad_(True), rand(8, 16, dtype=torch.bfloat16)
    with record_ops() as log:
        y = matmul(x, w)
        y.sum().backward()
    # the forward and dX: each the contract's product rounded once by the op (the epilogue on CUDA)
    assert log.count("tpinv::matmul") == 2 and "tpinv::matmul_partial" not in log
    assert "aten::mm" not in log and "aten::addmm" not in log and "aten::bmm" not in log


def test_opcheck():
    x, w = rand(4, 16), rand(8, 16)
    torch.library.opcheck(matmul_partial_op, (x, w, 8))
    torch.library.opcheck(matmul_op, (x.requires_grad_(True), w, 8, 8))
    torch.library.opcheck(tree_sum_op, (rand(3, 16), 4))


# ---- tree_sum -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_sum(dtype):
    x = rand(5, 8 * 21, dtype=dtype)
    assert_same_bits(tree_sum(x, 8), leaf_tree_sum(x.float(), 8), 'tree_sum(x, 8)')
    assert_same_bits(tree_sum(x[2:3], 1), leaf_tree_sum(x.float(), 1)[2:3], 'tree_sum(x[2:3], 1)')
    one = rand(4, 1)
    assert_same_bits(tree_sum(one, 1), one[:, 0], 'tree_sum(one, 1)')
    xg = x.float().requires_grad_(True)
    tree_sum(xg, 8).backward(torch.arange(5.0))
    assert_same_bits(xg.grad, torch.arange(5.0)[:, None].expand(5, 8 * 21), 'xg.grad')


# ---- errors and the CUDA slot ---------------------------------------------------------

def test_bad_inputs_raise_clear_errors():
    x, w = rand(3, 24), rand(5, 24)
    with pytest.raises(InvarianceError, match="K=24 is not divisible by leaves=16"):
        matmul_partial(x, w, 16)
    with pytest.raises(InvarianceError, match="power of two"):
        matmul_partial(x, w, 3)
    with pytest.raises(InvarianceError, match="power of two"):
        matmul(x, w, 8, grad_leaves=6)
    with pytest.raises(TypeError, match="w dtype torch.bfloat16 must equal x dtype torch.float32"):
        matmul_partial(x, w.bfloat16())
    with pytest.raises(TypeError, match="float64"):
        matmul_partial(x.double(), w.double())
    with pytest.raises(ValueError, match=r"w must be 2-D with shape \[N, K\], got shape \[1, 5, 24\]"):
        matmul_partial(x, w[None])
    with pytest.raises(ValueError, match=r"expected x \[\.\.\., 16\] for w \[N=5, K=16\]"):
        matmul_partial(x, w[:, :16])
    with pytest.raises(InvarianceError, match="N .* is not divisible by grad_leaves=8"):
        matmul(x.requires_grad_(True), rand(5, 24))
