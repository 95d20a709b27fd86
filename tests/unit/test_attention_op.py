"""``tpinv::attention`` as an op: registration, input errors, the primitives its kernels trust."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attention_cases import arange_pos, qkv
from tpinv.core.contract import InvarianceError
from tpinv.kernels.reference_attention import all_finite, halve, kv_block_range
from tpinv.kernels.reference_attention_bwd import halve_span
from tpinv.kernels.reference_tree import halving_sum
from tpinv.ops.attention import attention, attention_backward_op, attention_op
from tpinv.testing import assert_bits_differ, assert_same_bits, same_bits
from tpinv.testing.body_tail import body_tail_map

NEG_INF = float("-inf")


# ---------------------------------------------------------------- trusted primitives

def _position_variants(f, x: torch.Tensor):
    """``f`` on the whole tensor, on 7-element chunks, on a strided view, element by element."""
    whole = f(x)
    chunks = torch.cat([f(c) for c in x.split(7)])
    strided = f(torch.stack([x, x], 1)[:, 0])
    single = torch.cat([f(x[i:i + 1]) for i in range(x.numel())])
    return whole, chunks, strided, single


def _data() -> torch.Tensor:
    x = torch.randn(1001) * 6
    x[::13] = NEG_INF
    x[5::17] = -0.0
    return x


PRIMITIVES = {
    "exp": torch.exp,
    "log": lambda x: torch.log(x.abs()),
    "where": lambda x: torch.where(x > 0.3, x, 0.0),
    "maximum": lambda x: torch.maximum(x, torch.full_like(x, -0.5)),
    "sub_scalar_row": lambda x: torch.exp(x - 1.7),
    "plus_zero": lambda x: x + 0.0,
    "div": lambda x: x / 3.1,
    "to_bf16": lambda x: x.to(torch.bfloat16),
    "to_fp16": lambda x: x.to(torch.float16),
    "isfinite": torch.isfinite,
}


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_kernel_primitives_are_position_independent(name):
    whole, *others = _position_variants(PRIMITIVES[name], _data())
    for other in others:
        assert_same_bits(whole, other, 'whole')
        if whole.is_floating_point():
            assert_same_bits(torch.signbit(whole), torch.signbit(other), 'torch.signbit(whole)')


def test_cummax_is_the_running_maximum():
    """The forward's block-group running max: exact, whatever the layout."""
    x = _data().reshape(7, 143)
    running = [x[:, 0]]
    for i in range(1, x.shape[1]):
        running.append(torch.maximum(running[-1], x[:, i]))
    expected = torch.stack(running, 1)
    assert_same_bits(torch.cummax(x, dim=1).values, expected, 'torch.cummax(x, dim=1).values')
    assert_same_bits(torch.cummax(x.t().contiguous(), dim=0).values.t(), expected,
                     'torch.cummax(x.t().contiguous(), dim=0).values.t()')


def test_position_check_catches_a_body_tail_kernel():
    """Control: the same check flags an exp kernel whose vector body and scalar tail round
    differently (written out, so on every kernel set; torch.sigmoid does it on AVX-512/AVX2)."""
    def body_tail_exp(x):
        return body_tail_map(lambda t: torch.exp(t * 0.5) * torch.exp(t * 0.5), torch.exp, x)
    whole, *others = _position_variants(body_tail_exp, torch.randn(1001) * 6)
    assert any(not same_bits(whole, other) for other in others)


def test_plus_zero_makes_negative_zero_positive():
    z = torch.tensor([-0.0, 0.0, -1.5])
    assert_same_bits(torch.signbit(z + 0.0), torch.tensor([False, False, True]), 'torch.signbit(z + 0.0)')


@pytest.mark.parametrize("n", [1, 5, 13, 64, 100])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_halve_is_cpu_tree_halving_sum_along_any_dim(n, dim):
    shape = [3, 4, 5]
    shape[dim] = n
    x = torch.randn(*shape)
    assert_same_bits(halve(x, dim), halving_sum(x.movedim(dim, -1)), 'halve(x, dim)')
    if n == 100:  # control: torch.sum reduces in another order
        y = torch.randn(64, 1000)
        assert_bits_differ(halve(y, 1), y.sum(1), 'halve(y, 1)')


@settings(max_examples=40, deadline=None)
@given(log_n=st.integers(0, 8), data=st.data())
def test_halve_span_equals_halve_of_the_zero_filled_vector(log_n, data):
    n = 1 << log_n
    start = data.draw(st.integers(0, n))
    length = data.draw(st.integers(0, n - start))
    dim = data.draw(st.integers(0, 2))
    shape = [2, 3, 4]
    shape[dim] = length
    x = torch.randn(*shape)
    full_shape = list(shape)
    full_shape[dim] = n
    full = torch.zeros(full_shape)
    full.narrow(dim, start, length).copy_(x)
    assert_same_bits(halve_span(x, start, n, dim) + 0.0, halve(full, dim) + 0.0, 'halve_span(x, start, n, dim) + 0.0')


def test_halve_span_control_a_plain_sum_of_the_span_differs():
    x = torch.randn(64, 300)
    full = torch.cat([torch.zeros(64, 212), x], 1)
    assert_same_bits(halve_span(x, 212, 512, 1) + 0.0, halve(full, 1) + 0.0, 'halve_span(x, 212, 512, 1) + 0.0')
    assert_bits_differ(x.sum(1), halve(full, 1), 'x.sum(1)')


# ---------------------------------------------------------------- the op

def _inputs(B=2, Hkv=2, g=2, S=5, T=9, D=4, dtype=torch.float32):
    q, k, v = qkv(B, Hkv, g, S, T, D, dtype)
    return q, k, v, arange_pos(B, S, start=T - S)


def test_opcheck_forward_and_backward():
    q, k, v, pos = _inputs()
    mask = torch.rand(2, 5, 9) < 0.7
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), pos, mask, True, 3, 0.4)
    torch.library.opcheck(attention_op, args)
    out, lse = attention_op(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    bwd_args = (torch.randn_like(out), torch.randn_like(lse), q.detach(), k.detach(), v.detach(),
                out, lse, pos, mask, True, 3, 0.4)
    torch.library.opcheck(attention_backward_op, bwd_args)


def test_all_finite_sees_nan_and_inf_anywhere():
    x = torch.randn(3, 70, 5)
    assert all_finite(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 69, 4] = bad
        assert not all_finite(y)


def test_decode_touches_only_the_blocks_it_needs():
    one = lambda p: torch.tensor([p])  # noqa: E731
    assert kv_block_range(one(70), 600, True, None) == range(0, 2)
    assert kv_block_range(one(300), 600, True, 7) == range(4, 5)
    assert kv_block_range(one(64), 600, True, 2) == range(0, 2)
    assert kv_block_range(one(-1), 600, True, None) == range(0)
    assert kv_block_range(one(900), 600, True, None) == range(0, 10)
    assert kv_block_range(torch.tensor([3, 200]), 600, False, None) == range(0, 10)


def test_wrapper_returns_out_unless_asked_for_lse():
    q, k, v, pos = _inputs()
    out = attention(q, k, v, pos)
    out2, lse = attention(q, k, v, pos, return_lse=True)
    assert_same_bits(out, out2, 'out')
    assert lse.shape == (2, 4, 5)
    assert lse.dtype == torch.float32


def test_fake_tensors_give_shapes_without_running_the_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v, pos = _inputs(dtype=torch.bfloat16)
        out, lse = attention(q, k, v, pos, return_lse=True)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("case,error,expected", [
    ("hq_not_multiple", ValueError, "Hq = g * Hkv"),
    ("d_mismatch", ValueError, "[2, Hkv, T, 4]"),
    ("batch_mismatch", ValueError, "[2, Hkv, T, 4]"),
    ("v_shape", ValueError, "[2, 2, 9, 4]"),
    ("q_pos_shape", ValueError, "[B, S] = [2, 5]"),
    ("q_pos_dtype", ValueError, "int64"),
    ("dtype_mismatch", TypeError, "torch.bfloat16"),
    ("mask_shape", ValueError, "[B, S, T] = [2, 5, 9]"),
    ("mask_dtype", ValueError, "[B, S, T] = [2, 5, 9]"),
    ("q_rank", ValueError, "[B, Hq, S, D]"),
    ("window_zero", ValueError, "positive int"),
    ("window_not_causal", ValueError, "causal=True"),
    ("fp64", InvarianceError, "torch.float64"),
])
def test_bad_input_names_the_expected_shape(case, error, expected):
    q, k, v, pos = _inputs()
    kw = {}
    if case == "hq_not_multiple":
        q = torch.randn(2, 3, 5, 4)
    elif case == "d_mismatch":
        k = torch.randn(2, 2, 9, 6)
    elif case == "batch_mismatch":
        k, v = torch.randn(3, 2, 9, 4), torch.randn(3, 2, 9, 4)
    elif case == "v_shape":
        v = torch.randn(2, 2, 8, 4)
    elif case == "q_pos_shape":
        pos = torch.zeros(2, 4, dtype=torch.int64)
    elif case == "q_pos_dtype":
        pos = pos.to(torch.int32)
    elif case == "dtype_mismatch":
        k = k.to(torch.bfloat16)
        q = q.to(torch.bfloat16)
    elif case == "mask_shape":
        kw["mask"] = torch.ones(2, 5, 8, dtype=torch.bool)
    elif case == "mask_dtype":
        kw["mask"] = torch.ones(2, 5, 9)
    elif case == "q_rank":
        q = q[0]
    elif case == "window_zero":
        kw["window"] = 0
    elif case == "window_not_causal":
        kw.update(window=4, causal=False)
    elif case == "fp64":
        q, k, v = q.double(), k.double(), v.double()
    with pytest.raises(error) as info:
        attention(q, k, v, pos, **kw)
    assert expected in str(info.value)
