"""On CUDA, a document packed at any offset gets the forward bits of the document alone (Triton).

``tpinv::attention_packed``'s CUDA forward runs each query against its virtual row (keys at
their own positions) through the Triton attention kernel; the alone run is the plain
``tpinv::attention`` prefill.  Control: the same packed row on the slot grid (no ``k_pos``),
whose block boundaries fall inside the document.  The CUDA backward raises.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.ops.attention import attention
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("offset", [1, 37, 64, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_document_equals_alone_on_cuda(offset, dtype):
    gen = torch.Generator().manual_seed(offset)
    n, Hkv, g, D = 150, 2, 4, 64
    total = offset + n + 17
    q = torch.randn(1, Hkv * g, total, D, generator=gen).to(dtype).cuda()
    k, v = (torch.randn(1, Hkv, total, D, generator=gen).to(dtype).cuda() for _ in range(2))
    pos = torch.cat([torch.arange(offset), torch.arange(n), torch.arange(17)])[None].cuda()
    doc = torch.cat([torch.zeros(offset), torch.ones(n), 2 * torch.ones(17)]).cuda()
    mask = (doc[:, None] == doc[None, :])[None]
    span = slice(offset, offset + n)
    out, lse = attention(q, k, v, pos, mask=mask, k_pos=pos, return_lse=True)
    alone, alone_lse = attention(q[:, :, span].contiguous(), k[:, :, span].contiguous(),
                                 v[:, :, span].contiguous(), torch.arange(n)[None].cuda(), return_lse=True)
    assert_same_bits(out[:, :, span], alone, f"out at offset {offset}")
    assert_same_bits(lse[:, :, span], alone_lse, f"lse at offset {offset}")
    if offset % 64:
        _, slot_lse = attention(q, k, v, torch.arange(total)[None].cuda(), mask=mask, return_lse=True)
        assert_bits_differ(slot_lse[:, :, span], alone_lse, "slot grid (moved block boundary) vs alone")


def test_packed_backward_on_cuda_raises():
    q = torch.randn(1, 1, 4, 8, device="cuda", requires_grad=True)
    k, v = torch.randn(1, 1, 4, 8, device="cuda"), torch.randn(1, 1, 4, 8, device="cuda")
    pos = torch.arange(4)[None].cuda()
    out = attention(q, k, v, pos, k_pos=pos)
    with pytest.raises(NotImplementedError, match="attention_packed_backward"):
        out.sum().backward()
