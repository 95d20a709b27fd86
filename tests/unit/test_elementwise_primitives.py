"""Position independence of every torch elementwise primitive the invariant paths use.

An op is usable on an invariant path only if a value's result does not depend on where
it sits: whole tensor == 7-element chunks == single elements == a strided view == a
broadcast (stride-0) operand == an in-place update of a slice == 1 vs 2 threads, bitwise.
The vectorized body and the scalar tail of a kernel must agree, so sizes are odd.

Negative controls: a written-out kernel whose body and tail differ (every kernel set);
``torch.sigmoid`` (and so ``F.silu``) fails this check on this CPU
(AVX-512), its vectorized and scalar paths round differently; so does ``torch.rsqrt`` on
bf16/fp16 tensors (its scalar path differs from the vectorized one).  Use ``rsqrt`` on
fp32 only (upcast first); every other primitive here passes in fp32, bf16 and fp16.
"""
from __future__ import annotations

import zlib

import pytest
import torch
from tpinv.testing import assert_same_bits, num_threads, same_bits
from tpinv.testing.body_tail import body_tail_map

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZE = 1031                      # not a multiple of any vector width: body + tail
BIG = (1 << 17) + 5              # large enough for the intra-op thread pool


def positive(n, gen):
    return torch.rand(n, generator=gen) * 10 + 1e-3


def signed(n, gen):
    return torch.randn(n, generator=gen) * 3


UNARY = {
    "neg": (torch.neg, signed),
    "exp": (torch.exp, signed),
    "log": (torch.log, positive),
    "cos": (torch.cos, signed),
    "sin": (torch.sin, signed),
    "rsqrt": (torch.rsqrt, positive),
    "tanh": (torch.tanh, signed),
}
BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "maximum": torch.maximum,
    "where": lambda a, b: torch.where(a > b, a, b - a),
}
#: (op, dtype) pairs that are position dependent on this CPU: never on an invariant path.
POSITION_DEPENDENT = {("rsqrt", torch.bfloat16), ("rsqrt", torch.float16)}
INPLACE = {"add": torch.Tensor.add_, "sub": torch.Tensor.sub_, "mul": torch.Tensor.mul_,
           "div": torch.Tensor.div_}


def strided(t):
    """The same values as a stride-2 view into a larger buffer."""
    return torch.stack([t, torch.full_like(t, 7.0)], dim=-1)[..., 0]


def unary_differences(fn, x):
    """Names of the placements where ``fn`` gives other bits than on the whole tensor."""
    full = fn(x)
    variants = {
        "chunks of 7": torch.cat([fn(c) for c in x.split(7)]),
        "single elements": torch.stack([fn(x[i:i + 1])[0] for i in range(x.numel())]),
        "strided view": fn(strided(x)),
        "2-D": fn(x[:1030].reshape(10, 103)).reshape(-1),
    }
    bad = [name for name, got in variants.items() if not same_bits(got[:full.numel()], full[:got.numel()])]
    return bad


@pytest.mark.parametrize("name,dtype", [(n, d) for n in sorted(UNARY) for d in DTYPES
                                        if (n, d) not in POSITION_DEPENDENT])
def test_unary_position_independent(name, dtype):
    fn, make = UNARY[name]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = make(SIZE, gen).to(dtype)
    assert unary_differences(fn, x) == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_position_independent(name, dtype):
    fn = BINARY[name]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    a = signed(SIZE, gen).to(dtype)
    b = (positive if name == "div" else signed)(SIZE, gen).to(dtype)
    full = fn(a, b)
    assert_same_bits(torch.cat([fn(x, y) for x, y in zip(a.split(7), b.split(7))]), full,
                     'torch.cat([fn(x, y) for x, y in zip(a.split(7),...')
    assert_same_bits(torch.stack([fn(a[i:i + 1], b[i:i + 1])[0] for i in range(SIZE)]), full,
                     'torch.stack([fn(a[i:i + 1], b[i:i + 1])[0] for ...')
    assert_same_bits(fn(strided(a), strided(b)), full, 'fn(strided(a), strided(b))')
    assert_same_bits(fn(a[:1030].reshape(10, 103), b[:1030].reshape(10, 103)).reshape(-1), full[:1030],
                     'fn(a[:1030].reshape(10, 103), b[:1030].reshape(...')
    # A broadcast (stride-0) operand gives the bits of the materialised one.
    col = a[:103].reshape(103, 1)
    rows = b[:1030].reshape(10, 103)
    assert_same_bits(fn(col.t().expand(10, 103), rows), fn(col.t().expand(10, 103).contiguous(), rows),
                     'fn(col.t().expand(10, 103), rows)')
    assert_same_bits(fn(col.expand(103, 10), rows.t()), fn(col.expand(103, 10).contiguous(), rows.t()),
                     'fn(col.expand(103, 10), rows.t())')
    # A python scalar operand equals a tensor full of it.
    s = 0.0 if name != "div" else 3.0
    assert_same_bits(fn(a, torch.full_like(a, s)), fn(a, torch.tensor(s, dtype=dtype)), 'fn(a, torch.full_like(a, s))')


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(INPLACE))
def test_inplace_into_slices_matches_out_of_place(name, dtype):
    # The halving levels update a prefix of a buffer in place from the next block.
    gen = torch.Generator().manual_seed(3)
    buf = signed(2 * SIZE, gen).to(dtype)
    if name == "div":
        buf = buf.abs() + 0.5
    want = BINARY[name](buf[:SIZE], buf[SIZE:])
    INPLACE[name](buf[:SIZE], buf[SIZE:])
    assert_same_bits(buf[:SIZE], want, 'buf[:SIZE]')
    scalar = torch.randn(SIZE, generator=gen).to(dtype)
    want = BINARY[name](scalar, 0.5)
    INPLACE[name](scalar, 0.5)
    assert_same_bits(scalar, want, 'scalar')


@pytest.mark.parametrize("name", sorted(UNARY) + sorted(BINARY))
def test_threads_do_not_change_bits(name):
    gen = torch.Generator().manual_seed(5)
    a, b = positive(BIG, gen), positive(BIG, gen)
    fn = (lambda x: UNARY[name][0](x)) if name in UNARY else (lambda x: BINARY[name](x, b))
    with num_threads(1):
        one = fn(a)
    with num_threads(2):
        two = fn(a)
    assert_same_bits(one, two, 'one')


def test_control_body_tail_kernel_is_position_dependent():
    """The check fails a kernel whose vector body and scalar tail round differently, on every
    kernel set (the two formulas are written out; torch's own such kernels vary by set)."""
    gen = torch.Generator().manual_seed(0)
    x = signed(SIZE, gen)
    kernel = lambda t: body_tail_map(lambda u: torch.exp(u * 0.5) * torch.exp(u * 0.5), torch.exp, t)
    assert "single elements" in unary_differences(kernel, x)


def test_control_sigmoid_is_position_dependent():
    gen = torch.Generator().manual_seed(0)
    x = signed(SIZE, gen)
    bad = unary_differences(torch.sigmoid, x) + unary_differences(torch.nn.functional.silu, x)
    if not bad:
        pytest.skip("torch.sigmoid is position independent on this CPU; no control here")
    assert "single elements" in bad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_control_rsqrt_16bit_is_position_dependent(dtype):
    gen = torch.Generator().manual_seed(0)
    x = positive(SIZE, gen).to(dtype)
    bad = unary_differences(torch.rsqrt, x)
    if not bad:
        pytest.skip(f"torch.rsqrt on {dtype} is position independent on this CPU; no control here")
    assert "single elements" in bad
    # The fp32 path (upcast, rsqrt, round) is position independent.
    assert unary_differences(lambda t: torch.rsqrt(t.float()).to(dtype), x) == []
