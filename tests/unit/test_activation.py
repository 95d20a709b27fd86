"""tpinv.ops.activation.silu_mul: position independence, parity, errors.

On AVX-512/AVX2 ``F.silu`` (``torch.sigmoid``) gives different bits for a value depending on
whether it falls in the vectorized body or the scalar tail of a loop; on the generic kernel
set it does not.  The negative controls therefore use a written-out model of such a kernel
(``tpinv.testing.body_tail``: body ``g * (1 / (1 + exp(-g)))``, tail ``g / (1 + exp(-g))``)
on gate values where the two formulas disagree, so every layout change that moves an element
between the paths shows up on every machine.  tpinv's silu_mul is built from
position-independent ops and gives the same bits in every layout.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tpinv.testing import assert_bits_differ, assert_same_bits, num_threads, same_bits
from tpinv.testing.body_tail import body_tail_map
from tpinv.core.contract import InvarianceError
from tpinv.ops.activation import silu_mul, silu_mul_backward_op, silu_mul_op
from tpinv.ops.registry import cuda_kernel, has_cuda_kernel
from tpinv.testing import record_ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Parity with F.silu(gate) * up as (rtol, atol): in 16 bits PyTorch rounds silu(gate) before
# the product, tpinv rounds once.
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-3, 1e-3)}


def randn(*shape, dtype=torch.float32, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _silu_vector(g):
    return g * torch.reciprocal(torch.exp(-g) + 1.0)


def _silu_scalar(g):
    return g / (torch.exp(-g) + 1.0)


def body_tail_silu(g):
    """A SiLU kernel whose vector body and scalar tail round differently (the control)."""
    return body_tail_map(_silu_vector, _silu_scalar, g)


def tail_sensitive_values(count: int, seed: int = 0) -> torch.Tensor:
    """fp32 values whose SiLU differs between the control's body and tail formulas."""
    pool = randn(8192, seed=seed)
    sensitive = pool[_silu_vector(pool) != _silu_scalar(pool)]
    assert sensitive.numel() > 0, "the body and tail formulas agreed on every value: no control possible"
    return sensitive.repeat(count // sensitive.numel() + 1)[:count]


def vanilla(gate, up):
    return body_tail_silu(gate) * up


def tpinv_fwd_bwd(gate, up, grad):
    gate = gate.detach().clone().requires_grad_(True)
    up = up.detach().clone().requires_grad_(True)
    out = silu_mul(gate, up)
    out.backward(grad)
    return out.detach(), gate.grad, up.grad


def torch_fwd_bwd(gate, up, grad):
    gate = gate.detach().clone().requires_grad_(True)
    up = up.detach().clone().requires_grad_(True)
    out = F.silu(gate) * up
    out.backward(grad)
    return out.detach(), gate.grad, up.grad


def same(a, b):
    return all(same_bits(x, y) for x, y in zip(a, b))


def chunked(fn, *tensors, size=7):
    """``fn`` on consecutive chunks of ``size`` elements of the flattened inputs."""
    flats = [t.reshape(-1) for t in tensors]
    pieces = [fn(*parts) for parts in zip(*(f.split(size) for f in flats))]
    return [torch.cat(p).reshape(tensors[0].shape) for p in zip(*pieces)]


# --- row alone / chunks / single elements ----------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("hidden", [40, 72])
def test_rows_chunks_and_elements_equal_full(dtype, batch, hidden):
    gate, up, grad = (randn(batch, hidden, dtype=dtype, seed=s) for s in (batch, hidden, 99))
    full = tpinv_fwd_bwd(gate, up, grad)
    rows = [tpinv_fwd_bwd(gate[i:i + 1], up[i:i + 1], grad[i:i + 1]) for i in range(batch)]
    assert same(full, [torch.cat(r) for r in zip(*rows)])
    assert same(full, chunked(tpinv_fwd_bwd, gate, up, grad, size=7))
    assert same(full, chunked(tpinv_fwd_bwd, gate, up, grad, size=1))


def test_rows_chunks_and_elements_vanilla_differs():
    gate = tail_sensitive_values(3 * 72).reshape(3, 72)
    up = randn(3, 72, seed=1)
    full = vanilla(gate, up)
    rows = torch.cat([vanilla(gate[i:i + 1], up[i:i + 1]) for i in range(3)])
    assert_bits_differ(full, rows, 'full')
    assert_bits_differ(full, chunked(lambda g, u: [vanilla(g, u)], gate, up)[0], 'full')
    ours_rows = torch.cat([silu_mul(gate[i:i + 1], up[i:i + 1]) for i in range(3)])
    assert_same_bits(silu_mul(gate, up), ours_rows, 'silu_mul(gate, up)')


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 9), hidden=st.integers(1, 97), seed=st.integers(0, 2**16))
def test_row_alone_property(batch, hidden, seed):
    gate, up = randn(batch, hidden, seed=seed), randn(batch, hidden, seed=seed + 1)
    row = seed % batch
    assert_same_bits(silu_mul(gate, up)[row:row + 1], silu_mul(gate[row:row + 1], up[row:row + 1]),
                     'silu_mul(gate, up)[row:row + 1]')


# --- padding ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_does_not_change_results(dtype):
    gate, up, grad = (randn(2, 9, 72, dtype=dtype, seed=s) for s in (1, 2, 3))
    pad = [randn(2, 4, 72, dtype=dtype, seed=s) for s in (4, 5, 6)]
    padded = [torch.cat([t, p], dim=1) for t, p in zip((gate, up, grad), pad)]
    full = tpinv_fwd_bwd(gate, up, grad)
    assert same(full, [t[:, :9] for t in tpinv_fwd_bwd(*padded)])


def test_padding_vanilla_differs():
    gate = tail_sensitive_values(9 * 40).reshape(1, 9, 40)
    up = randn(1, 9, 40, seed=2)
    padded_gate = torch.cat([gate, randn(1, 3, 40, seed=3)], dim=1)
    padded_up = torch.cat([up, randn(1, 3, 40, seed=4)], dim=1)
    assert_bits_differ(vanilla(gate, up), vanilla(padded_gate, padded_up)[:, :9], 'vanilla(gate, up)')
    assert_same_bits(silu_mul(gate, up), silu_mul(padded_gate, padded_up)[:, :9], 'silu_mul(gate, up)')


# --- threads ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_one_thread_equals_two_threads(dtype):
    gate, up, grad = (randn(65566, dtype=dtype, seed=s) for s in (7, 8, 9))
    with num_threads(1):
        one = tpinv_fwd_bwd(gate, up, grad)
    with num_threads(2):
        two = tpinv_fwd_bwd(gate, up, grad)
    assert same(one, two)


def test_threads_vanilla_differs():
    gate, up = tail_sensitive_values(65566), randn(65566, seed=8)
    with num_threads(1):
        one = vanilla(gate, up)
    with num_threads(2):
        two = vanilla(gate, up)
    assert_bits_differ(one, two, 'one')


# --- strides ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_equals_contiguous(dtype):
    gate, up, grad = (randn(37, 72, dtype=dtype, seed=s) for s in (1, 2, 3))
    strided = [t.t().contiguous().t() for t in (gate, up, grad)]
    assert not strided[0].is_contiguous()
    assert same(tpinv_fwd_bwd(gate, up, grad), tpinv_fwd_bwd(*strided))


def test_strided_vanilla_differs():
    gate, up = tail_sensitive_values(37 * 72).reshape(37, 72), randn(37, 72, seed=2)
    strided_gate, strided_up = gate.t().contiguous().t(), up.t().contiguous().t()
    assert_bits_differ(vanilla(gate, up), vanilla(strided_gate, strided_up), 'vanilla(gate, up)')
    assert_same_bits(silu_mul(gate, up), silu_mul(strided_gate, strided_up), 'silu_mul(gate, up)')


# --- the primitives silu_mul is built from are position independent ------------------------

PRIMITIVES = {
    "neg": torch.neg,
    "exp": torch.exp,
    "reciprocal": torch.reciprocal,
    "add_scalar": lambda t: t + 1.0,
    "rsub_scalar": lambda t: 1.0 - t,
    "div": lambda t: t / (t * t + 1.0),
    "to_bf16": lambda t: t.to(torch.bfloat16),
    "to_fp16": lambda t: t.to(torch.float16),
    "bf16_to_fp32": lambda t: t.to(torch.bfloat16).to(torch.float32),
}


@pytest.mark.parametrize("name", PRIMITIVES)
def test_primitive_is_position_independent(name):
    fn = PRIMITIVES[name]
    x = randn(1001, seed=3)
    full = fn(x)
    assert_same_bits(full, torch.cat([fn(c) for c in x.split(7)]), 'full')
    assert_same_bits(full, torch.stack([fn(v) for v in x]), 'full')
    wide = torch.zeros(2002)
    wide[::2] = x
    assert_same_bits(full, fn(wide[::2]), 'full')


def test_primitive_check_catches_a_body_tail_kernel():
    x = tail_sensitive_values(1001)
    assert_bits_differ(body_tail_silu(x), torch.cat([body_tail_silu(c) for c in x.split(7)]), "control")


# --- parity ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_parity_with_torch(dtype):
    gate, up, grad = (randn(9, 72, dtype=dtype, seed=s) for s in (11, 12, 13))
    ours = tpinv_fwd_bwd(gate, up, grad)
    ref_out = torch_fwd_bwd(gate, up, grad)[0]
    ref = torch_fwd_bwd(gate.float(), up.float(), grad.float())
    rtol, atol = TOL[dtype]
    assert ours[0].dtype == dtype
    torch.testing.assert_close(ours[0], ref_out, rtol=rtol, atol=atol)
    for a, b in zip(ours, ref):  # backward against PyTorch's fp32 gradients
        torch.testing.assert_close(a, b.to(dtype), rtol=rtol, atol=atol)


# --- the op ran, registration, errors ---------------------------------------------------

def test_custom_ops_run_and_are_registered():
    gate, up, grad = randn(3, 5), randn(3, 5, seed=1), randn(3, 5, seed=2)
    with record_ops() as log:
        tpinv_fwd_bwd(gate, up, grad)
    assert "tpinv::silu_mul" in log and "tpinv::silu_mul_backward" in log
    torch.library.opcheck(torch.ops.tpinv.silu_mul.default,
                          (gate.requires_grad_(), up.requires_grad_()),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_bad_inputs():
    gate = randn(3, 5)
    with pytest.raises(InvarianceError, match=r"shape \(3, 5\)"):
        silu_mul(gate, randn(3, 6))
    with pytest.raises(TypeError, match="dtype"):
        silu_mul(gate, gate.bfloat16())
    with pytest.raises(InvarianceError, match="dtype"):
        silu_mul(gate.double(), gate.double())
    with pytest.raises(InvarianceError, match="dtype"):
        silu_mul(gate.to(torch.int32), gate.to(torch.int32))
