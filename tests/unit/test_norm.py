"""tpinv.ops.norm.rms_norm: bitwise invariance (batch, padding, threads, strides), parity, errors.

Each invariance test has a negative control beside it: Hugging Face's LlamaRMSNorm (torch
mean / autograd sums) run through the same comparison gives different bits.
"""
from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tpinv.testing import assert_bits_differ, assert_same_bits, num_threads, same_bits
from tpinv.core.contract import InvarianceError
from tpinv.kernels.reference_tree import halving_sum
from tpinv.ops.norm import rms_norm, rms_norm_backward_heads_op, rms_norm_backward_op, rms_norm_op
from tpinv.ops.registry import cuda_kernel, has_cuda_kernel
from tpinv.testing import record_ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS = 1e-6
# Parity with HF (fwd, bwd) as (rtol, atol): fp32 differs only in summation order; the
# 16-bit HF backward rounds its intermediates to 16 bits, tpinv keeps them in fp32.
FWD_TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-3, 1e-3)}
BWD_TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (5e-2, 5e-2), torch.float16: (5e-3, 5e-3)}


def inputs(tokens: int, hidden: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    grad = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return x, weight, grad


def tpinv_fwd_bwd(x, weight, grad):
    x = x.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    y = rms_norm(x, weight, EPS)
    y.backward(grad.to(y.dtype))
    return y.detach(), x.grad, weight.grad


def hf_fwd_bwd(x, weight, grad):
    norm = LlamaRMSNorm(x.shape[-1], eps=EPS).to(weight.dtype)
    norm.weight.data = weight.detach().clone()
    x = x.detach().clone().requires_grad_(True)
    y = norm(x)
    y.backward(grad.to(y.dtype))
    return y.detach(), x.grad, norm.weight.grad


def rows_alone(fn, x, weight, grad):
    results = [fn(x[i:i + 1], weight, grad[i:i + 1]) for i in range(x.shape[0])]
    return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])


# --- row alone == row in batch ------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("hidden", [40, 72])
def test_row_alone_equals_row_in_batch(dtype, batch, hidden):
    x, weight, grad = inputs(batch, hidden, dtype, seed=batch * hidden)
    y, dx, _ = tpinv_fwd_bwd(x, weight, grad)
    y_alone, dx_alone = rows_alone(tpinv_fwd_bwd, x, weight, grad)
    assert_same_bits(y, y_alone, 'y')
    assert_same_bits(dx, dx_alone, 'dx')


def test_row_alone_vanilla_differs():
    x, weight, grad = inputs(8, 40000)
    with num_threads(2):
        y, dx, _ = hf_fwd_bwd(x, weight, grad)
        y_alone, dx_alone = rows_alone(hf_fwd_bwd, x, weight, grad)
        ours = tpinv_fwd_bwd(x, weight, grad)
        ours_alone = rows_alone(tpinv_fwd_bwd, x, weight, grad)
    assert_bits_differ(y, y_alone, 'y')
    assert_bits_differ(dx, dx_alone, 'dx')
    assert_same_bits(ours[0], ours_alone[0], 'ours[0]')
    assert_same_bits(ours[1], ours_alone[1], 'ours[1]')


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 9), hidden=st.integers(1, 97), seed=st.integers(0, 2**16))
def test_row_alone_property(batch, hidden, seed):
    x, weight, grad = inputs(batch, hidden, torch.float32, seed)
    row = seed % batch
    y, dx, _ = tpinv_fwd_bwd(x, weight, grad)
    y1, dx1, _ = tpinv_fwd_bwd(x[row:row + 1], weight, grad[row:row + 1])
    assert_same_bits(y[row:row + 1], y1, 'y[row:row + 1]')
    assert_same_bits(dx[row:row + 1], dx1, 'dx[row:row + 1]')


# --- padding ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,pad", [(7, 6), (13, 3), (5, 27)])
def test_padding_does_not_change_results(dtype, tokens, pad):
    """Padding tokens (any x, zero gradient) appended: real rows and dweight keep their bits."""
    x, weight, grad = inputs(tokens + pad, 40, dtype, seed=tokens)
    grad[tokens:] = 0
    y, dx, dw = tpinv_fwd_bwd(x[:tokens], weight, grad[:tokens])
    y_pad, dx_pad, dw_pad = tpinv_fwd_bwd(x, weight, grad)
    assert_same_bits(y, y_pad[:tokens], 'y')
    assert_same_bits(dx, dx_pad[:tokens], 'dx')
    assert_same_bits(dw, dw_pad, 'dw')
    # Padded as [B, S, H] sequences: dweight over the flattened tokens, same bits.
    _, _, dw_3d = tpinv_fwd_bwd(x.reshape(1, tokens + pad, 40), weight, grad.reshape(1, tokens + pad, 40))
    assert_same_bits(dw, dw_3d, 'dw')


def test_padding_vanilla_differs():
    x, weight, grad = inputs(13, 40, seed=7)
    grad[7:] = 0
    _, _, dw = hf_fwd_bwd(x[:7], weight, grad[:7])
    _, _, dw_pad = hf_fwd_bwd(x, weight, grad)
    assert_bits_differ(dw, dw_pad, 'dw')
    assert_same_bits(tpinv_fwd_bwd(x[:7], weight, grad[:7])[2], tpinv_fwd_bwd(x, weight, grad)[2],
                     'tpinv_fwd_bwd(x[:7], weight, grad[:7])[2]')


def test_dweight_order_differs_from_torch_sum():
    """dweight is the fixed token tree, not torch.sum's order; the two disagree somewhere."""
    x, weight, grad = inputs(37, 72, seed=3)
    _, _, dw = tpinv_fwd_bwd(x, weight, grad)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    dw_sum = (grad * normed).sum(0)
    assert_bits_differ(dw, dw_sum, 'dw')
    torch.testing.assert_close(dw, dw_sum, rtol=1e-5, atol=1e-5)


# --- threads --------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 70000), (3, 72), (64, 40)])
def test_one_thread_equals_two_threads(shape):
    x, weight, grad = inputs(*shape, seed=11)
    with num_threads(1):
        one = tpinv_fwd_bwd(x, weight, grad)
    with num_threads(2):
        two = tpinv_fwd_bwd(x, weight, grad)
    for a, b in zip(one, two):
        assert_same_bits(a, b, 'a')


def test_threads_control_summation_order():
    """Control for the test above, by construction: on these inputs a change of the summation
    order itself (each row rotated by one, so its squares pair up differently in the tree)
    changes the output bits, so the thread comparison could fail.  (Reversing a row would not:
    the halving tree pairs the same elements.)"""
    x, weight, grad = inputs(256, 40, seed=11)
    y = tpinv_fwd_bwd(x, weight, grad)[0]
    rotated = tpinv_fwd_bwd(x.roll(1, -1), weight.roll(1, -1), grad.roll(1, -1))[0].roll(-1, -1)
    assert_bits_differ(rotated, y, "rms_norm of rotated rows vs rms_norm")


# --- strides ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [40, 72])
def test_strided_equals_contiguous(dtype, hidden):
    x, weight, grad = inputs(5, hidden, dtype, seed=hidden)
    x_strided = x.t().contiguous().t()
    assert not x_strided.is_contiguous()
    contiguous = tpinv_fwd_bwd(x, weight, grad)
    strided = tpinv_fwd_bwd(x_strided, weight, grad)
    for a, b in zip(contiguous, strided):
        assert_same_bits(a, b, 'a')
    # A strided view into a wider buffer.
    wide = torch.zeros(5, 2 * hidden, dtype=dtype)
    wide[:, ::2] = x
    assert_same_bits(rms_norm(wide[:, ::2], weight, EPS), contiguous[0], 'rms_norm(wide[:, ::2], weight, EPS)')


def test_strided_vanilla_differs():
    x, weight, grad = inputs(5, 72, seed=72)
    contiguous = hf_fwd_bwd(x, weight, grad)
    strided = hf_fwd_bwd(x.t().contiguous().t(), weight, grad)
    assert_bits_differ(contiguous[0], strided[0], 'contiguous[0]')
    assert_bits_differ(contiguous[1], strided[1], 'contiguous[1]')


# --- parity with Hugging Face ---------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_parity_with_hf(dtype):
    x, weight, grad = inputs(9, 72, dtype, seed=5)
    ours, ref = tpinv_fwd_bwd(x, weight, grad), hf_fwd_bwd(x, weight, grad)
    assert ours[0].dtype == ref[0].dtype == dtype
    rtol, atol = FWD_TOL[dtype]
    torch.testing.assert_close(ours[0], ref[0], rtol=rtol, atol=atol)
    rtol, atol = BWD_TOL[dtype]
    torch.testing.assert_close(ours[1], ref[1], rtol=rtol, atol=atol)
    torch.testing.assert_close(ours[2].float(), ref[2].float(), rtol=rtol, atol=atol * 10)


def test_mixed_dtype_follows_hf_promotion():
    x, weight, grad = inputs(4, 40, torch.bfloat16)
    weight = weight.float()
    ours, ref = tpinv_fwd_bwd(x, weight, grad), hf_fwd_bwd(x, weight, grad)
    assert ours[0].dtype == ref[0].dtype == torch.float32
    assert ours[1].dtype == torch.bfloat16 and ours[2].dtype == torch.float32
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-6)


# --- the op ran, registration, errors ---------------------------------------------------

def test_custom_ops_run():
    x, weight, grad = inputs(3, 40)
    with record_ops() as log:
        tpinv_fwd_bwd(x, weight, grad)
    assert "tpinv::rms_norm" in log
    assert "tpinv::rms_norm_backward" in log


def test_opcheck():
    x, weight, _ = inputs(3, 40)
    torch.library.opcheck(torch.ops.tpinv.rms_norm.default,
                          (x.requires_grad_(), weight.requires_grad_(), EPS),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_bad_inputs():
    x, weight, _ = inputs(3, 40)
    with pytest.raises(InvarianceError, match=r"shape \(40,\)"):
        rms_norm(x, weight[:39])
    with pytest.raises(InvarianceError, match=r"\[\.\.\., H\]"):
        rms_norm(torch.tensor(1.0), weight)
    with pytest.raises(InvarianceError, match="dtype"):
        rms_norm(x.double(), weight)
    with pytest.raises(InvarianceError, match="dtype"):
        rms_norm(x, weight.to(torch.int32))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, weight, -1.0)

# ------------------------------------------------------------------ per-head weight gradient
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_heads_is_each_head_alone(dtype):
    """One call over [B, S, heads, D]: dx and each head's dweight row are the bits of a call
    on that head's slice alone."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 37, 6, 16, generator=gen) * 3).to(dtype)
    grad = torch.randn(2, 37, 6, 16, generator=gen).to(dtype)
    w = (1 + 0.2 * torch.randn(16, generator=gen)).to(dtype)
    dx, per_head = rms_norm_backward_heads_op(grad, x, w, EPS)
    assert per_head.shape == (6, 16) and per_head.dtype == dtype
    for h in range(6):
        dx_h, dw_h = rms_norm_backward_op(grad[..., h, :].contiguous(), x[..., h, :].contiguous(), w, EPS)
        assert_same_bits(dx[..., h, :], dx_h, 'dx[..., h, :]')
        assert_same_bits(per_head[h], dw_h, 'per_head[h]')


def test_backward_heads_one_token_sum_differs_control():
    """Negative control: one token sum over all (token, head) rows is not the per-head order
    (with 6 heads: for a power-of-two head count the interleaved halving factorises)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 41, 6, 16, generator=gen) * 10.0 ** torch.randint(-3, 4, (3, 41, 6, 16), generator=gen)
    grad = torch.randn(3, 41, 6, 16, generator=gen)
    w = torch.rand(16, generator=gen) + 0.5
    _, per_head = rms_norm_backward_heads_op(grad, x, w, EPS)
    _, all_rows = rms_norm_backward_op(grad, x, w, EPS)
    assert_bits_differ(halving_sum(per_head.t()), all_rows, 'halving_sum(per_head.t())')
    torch.testing.assert_close(halving_sum(per_head.t()), all_rows, rtol=1e-4, atol=1e-4)


def test_backward_heads_needs_a_head_dim():
    with pytest.raises(InvarianceError, match=r"\[\.\.\., heads, H\]"):
        rms_norm_backward_heads_op(torch.ones(16), torch.ones(16), torch.ones(16), EPS)
