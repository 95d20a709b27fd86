"""``torch.library.opcheck`` on every ``tpinv::`` op: schema, autograd registration, fake kernel
(shapes, dtypes and strides against the real kernel) and AOT dispatch with dynamic shapes.

The cases are keyed by qualified name and the first test compares them with
:data:`tpinv.ops.registry.OPS`: an op defined without a case here fails the suite.  Inputs
include non-contiguous views (a transposed ``q``, as the model passes it): attention and rope
declare outputs in their input's layout, every other op contiguous outputs, and opcheck holds
the kernels to it; the control test shows opcheck catching a fake whose layout the kernel does
not return.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.core.versions import torch_at_least

import tpinv.ops  # noqa: F401  (defines every op)
from tpinv.ops.registry import OPS
from tpinv.ops.rope import _encode_scaling

ops = torch.ops.tpinv


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32, grad=False):
    return torch.randn(*shape, generator=_g(seed)).to(dtype).requires_grad_(grad)


def _heads_transposed(B, S, H, D, seed, grad=False):
    """``[B, H, S, D]`` as the model makes it: a transposed view of ``[B, S, H, D]``."""
    base = _randn(B, S, H, D, seed=seed)
    return base.transpose(1, 2).requires_grad_(grad) if grad else base.transpose(1, 2)


def _attention_case(grad):
    B, Hq, Hkv, S, D = 2, 4, 2, 5, 8
    q = _heads_transposed(B, S, Hq, D, 1, grad)
    k, v = _heads_transposed(B, S, Hkv, D, 2, grad), _heads_transposed(B, S, Hkv, D, 3, grad)
    pos = torch.arange(S).expand(B, S).contiguous()
    return q, k, v, pos


def _attention_backward_case(packed: bool):
    q, k, v, pos = _attention_case(False)
    mask = torch.ones(2, 5, 5, dtype=torch.bool)
    if packed:
        out, lse = ops.attention_packed(q, k, v, pos, pos, mask, True, 3, 0.5)
        return (_randn(*out.shape, seed=4), _randn(*lse.shape, seed=5), q, k, v, out, lse, pos, pos, mask,
                True, 3, 0.5)
    out, lse = ops.attention(q, k, v, pos, None, True, None, 0.5)
    return (_randn(*out.shape, seed=4).transpose(1, 2).contiguous().transpose(1, 2), None, q, k, v, out, lse,
            pos, None, True, None, 0.5)


def _softmax_rows(grad):
    return _randn(3, 16, seed=7, grad=grad)


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}


def _cases() -> dict[str, list[tuple]]:
    """Sample inputs per op (lazily built: several read other ops' outputs)."""
    ids = torch.tensor([[3, 1, 3], [0, 15, 3]])
    x3 = _randn(2, 3, 16, seed=11)
    rows = _randn(3, 16, seed=12)
    row_max = rows.amax(-1)
    total = torch.rand(2, 3, generator=_g(13)) + 0.5
    ce_x = _randn(2, 3, 16, seed=14)
    ce_lse = torch.logsumexp(ce_x, -1)
    target = torch.tensor([[1, 20, 3], [15, 0, 2]])
    outside = target >= 16
    return {
        "tpinv::attention": [(*_attention_case(True), None, True, None, 0.25),
                             (*_attention_case(False), torch.ones(2, 5, 5, dtype=torch.bool), True, 3, 0.25)],
        "tpinv::attention_backward": [_attention_backward_case(False)],
        "tpinv::attention_packed": [(*_attention_case(True)[:3], *(_attention_case(False)[3],) * 2,
                                     torch.ones(2, 5, 5, dtype=torch.bool), True, None, 0.25)],
        "tpinv::attention_packed_backward": [_attention_backward_case(True)],
        "tpinv::embedding": [(ids, _randn(16, 8, seed=15, grad=True))],
        "tpinv::embedding_backward": [(_randn(2, 3, 8, seed=16), ids, 16)],
        "tpinv::matmul_partial": [(x3, _randn(8, 16, seed=17), 8), (x3.transpose(0, 1), _randn(8, 16, seed=17), 4)],
        "tpinv::matmul": [(_randn(2, 3, 16, seed=18, grad=True), _randn(8, 16, seed=19, grad=True), 8, 8),
                          (_randn(3, 16, seed=18, dtype=torch.bfloat16, grad=True),
                           _randn(8, 16, seed=19, dtype=torch.bfloat16, grad=True), 8, 4)],
        "tpinv::tree_sum": [(_randn(3, 16, seed=20, grad=True), 8), (rows.t().contiguous().t(), 4)],
        "tpinv::rms_norm": [(_randn(2, 3, 16, seed=21, grad=True), _randn(16, seed=22, grad=True), 1e-6),
                            (_heads_transposed(2, 3, 4, 16, 23, True), _randn(16, seed=22), 1e-5)],
        "tpinv::rms_norm_backward": [(_randn(2, 3, 16, seed=24), x3, _randn(16, seed=22), 1e-6)],
        "tpinv::rms_norm_backward_heads": [(_randn(2, 3, 4, 16, seed=25), _randn(2, 3, 4, 16, seed=26),
                                            _randn(16, seed=22), 1e-6)],
        "tpinv::rope_cos_sin": [(torch.arange(5).expand(2, 5).contiguous(), 8, 10000.0, None),
                                (torch.arange(5), 16, 500000.0, _encode_scaling(_LLAMA3))],
        "tpinv::apply_rope": [(_heads_transposed(2, 5, 4, 8, 27, True), *ops.rope_cos_sin(
            torch.arange(5).expand(2, 5).contiguous(), 8, 10000.0, None))],
        "tpinv::apply_rope_backward": [(_heads_transposed(2, 5, 4, 8, 28), *ops.rope_cos_sin(
            torch.arange(5), 8, 10000.0, None))],
        "tpinv::softmax": [(_softmax_rows(True), 8)],
        "tpinv::log_softmax": [(_softmax_rows(True), 4)],
        "tpinv::logsumexp": [(_softmax_rows(True), 8)],
        "tpinv::softmax_backward": [(_randn(3, 16, seed=29), rows, 8)],
        "tpinv::log_softmax_backward": [(_randn(3, 16, seed=29), rows, 8)],
        "tpinv::logsumexp_backward": [(_randn(3, seed=30), rows, 8)],
        "tpinv::sum_exp_partial": [(rows.clone().requires_grad_(), row_max, 4)],
        "tpinv::sum_exp_partial_backward": [(_randn(3, seed=31), rows, row_max)],
        "tpinv::silu_mul": [(_randn(2, 3, 8, seed=32, grad=True), _randn(2, 3, 8, seed=33, grad=True))],
        "tpinv::silu_mul_backward": [(_randn(2, 3, 8, seed=34), _randn(2, 3, 8, seed=32),
                                      _randn(2, 3, 8, seed=33))],
        "tpinv::cross_entropy_lse": [(total, total.log())],
        "tpinv::cross_entropy_grad": [(ce_x, ce_lse, target.masked_fill(outside, 0), outside, _randn(2, 3, seed=35)),
                                      (ce_x.transpose(0, 1), ce_lse.t(), target.t(), outside.t(),
                                       torch.ones(1).expand(3, 2)),
                                      (ce_x.bfloat16(), ce_lse, target.masked_fill(outside, 0), outside,
                                       _randn(2, 3, seed=36))],
    }


CASES = _cases()


def test_every_op_has_a_case():
    library = {q for q, d in OPS.items() if d.reference.__module__.startswith("tpinv.")}  # not tests' probes
    assert library - set(CASES) == set(), "ops without an opcheck case in tests/unit/test_opcheck.py"
    assert set(CASES) - library == set(), "cases for ops that are not defined"


@pytest.mark.parametrize("qualname", sorted(CASES))
def test_opcheck(qualname):
    op = getattr(ops, qualname.split("::")[1])
    for args in CASES[qualname]:
        torch.library.opcheck(op, args)


@pytest.mark.skipif(not torch_at_least((2, 13)),
                    reason="torch.library.opcheck compares the fake's strides with the kernel's from torch 2.13 "
                           "on (2.6, 2.11 and 2.12 checked: theirs does not), so this control cannot fail here")
def test_opcheck_control_fake_with_input_strides():
    """Control: a fake that copies its input's layout (``empty_like``) where the kernel returns a
    contiguous tensor -- the defect of ``tpinv::attention``'s fake before the registry put every
    output in one declared layout -- fails opcheck on the transposed ``q``."""

    @torch.library.custom_op("tpinv_test::contiguous_copy", mutates_args=())
    def contiguous_copy(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous() * 1

    contiguous_copy.register_fake(lambda x: torch.empty_like(x))
    q = _heads_transposed(2, 5, 4, 8, 1)
    assert not q.is_contiguous()
    with pytest.raises(Exception, match="Stride mismatch"):
        torch.library.opcheck(contiguous_copy, (q,), test_utils="test_faketensor")
    torch.library.opcheck(contiguous_copy, (q.contiguous(),), test_utils="test_faketensor")
