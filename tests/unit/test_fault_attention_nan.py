"""NaN propagates through the invariant attention as through PyTorch's: a NaN key makes the
output and lse of every query that sees it NaN (not 0 and -inf); the others keep their bits."""
from __future__ import annotations

import torch

from tpinv.kernels.reference_attention import attention_forward
from tpinv.testing import assert_same_bits


def _qkv(S=80, D=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(1, 2, S, D, generator=g).to(dtype) for _ in range(3)]


def test_nan_key_reaches_exactly_the_queries_that_see_it():
    q, k, v = _qkv()
    pos = torch.arange(80)[None]
    clean_out, clean_lse = attention_forward(q, k, v, pos)
    k[:, :, 70, 5] = float("nan")  # slot 70, in the second KV block
    out, lse = attention_forward(q, k, v, pos)
    assert out[:, :, 70:].isnan().all() and lse[:, :, 70:].isnan().all()
    assert_same_bits(out[:, :, :70], clean_out[:, :, :70], "queries before the NaN key")
    assert_same_bits(lse[:, :, :70], clean_lse[:, :, :70], "their lse")
    # PyTorch's attention marks the same outputs NaN
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_same_bits(ref.isnan(), out.isnan(), "NaN positions")
    # a NaN key in a slot no query may see stays invisible (a cache slot beyond the prompt)
    k2 = k.clone()
    k2[:, :, 70:] = float("nan")
    out2, lse2 = attention_forward(q[:, :, :70], k2, v, pos[:, :70])
    assert_same_bits(out2, clean_out[:, :, :70], "NaN only in invisible slots")


def test_nan_in_bf16_and_a_window():
    q, k, v = _qkv(dtype=torch.bfloat16)
    k[:, :, 30, 0] = float("nan")
    out, lse = attention_forward(q, k, v, torch.arange(80)[None], window=8)
    seen = torch.zeros(80, dtype=torch.bool)
    seen[30:38] = True  # p - 8 < 30 <= p
    assert_same_bits(out.isnan().any(-1)[0, 0], seen, "NaN outputs")
    assert_same_bits(lse.isnan()[0, 0], seen, "NaN lse")
