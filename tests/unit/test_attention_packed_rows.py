"""The packed forward as one query per batch row of ``tpinv::attention`` (the CUDA slot's method
for visibility that is not per-document) gives the bits of the packed CPU kernel -- run here on CPU, where ``tpinv::attention`` is the
reference kernel; tests/gpu/test_attention_packed_cuda.py runs it on the Triton kernel."""
from __future__ import annotations

import torch

from tpinv.ops.attention_packed import attention_packed_op, packed_forward_by_rows
from tpinv.testing import assert_same_bits


def test_rows_method_equals_packed_kernel():
    gen = torch.Generator().manual_seed(0)
    B, Hkv, g, S, D = 2, 2, 2, 90, 8
    q = torch.randn(B, Hkv * g, S, D, generator=gen)
    k, v = (torch.randn(B, Hkv, S, D, generator=gen) for _ in range(2))
    pos = torch.cat([torch.arange(21), torch.arange(S - 21)]).expand(B, S).contiguous()
    doc = (torch.arange(S) >= 21).long()
    mask = (doc[:, None] == doc[None, :]).expand(B, S, S).contiguous()
    ref = attention_packed_op(q, k, v, pos, pos, mask, True, None, 0.3)
    rows = packed_forward_by_rows(q, k, v, pos, pos, mask, True, None, 0.3, max_rows=16)
    assert_same_bits(rows[0], ref[0], "out")
    assert_same_bits(rows[1], ref[1], "lse")
