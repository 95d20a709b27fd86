"""The held softmax statistics' combine launch on a GPU: each row's logsumexp has torch's bytes.

:func:`tpinv.kernels.triton_softmax_combine.combine_sums` over every fp32 total a row can have,
against :func:`logsumexp_from_parts`; the held kernels that publish its inputs are compared with
the row kernel in ``tests/gpu/test_softmax_by_leaves.py``.  Skips without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.kernels.reference_softmax import logsumexp_from_parts
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda"


def test_the_combine_s_logsumexp_gives_torch_s_bits_on_every_row_total():
    """The statistics' combine launch (:func:`tpinv.kernels.triton_softmax_combine.combine_sums`, two
    leaves of sums ``(t, +0)``, so each row's total is ``t``) writes
    :func:`logsumexp_from_parts`'s bytes in fp32, bf16 and fp16 for every fp32 ``t`` a row's
    total can be (0, each fp32 in ``[1, 2**32)``, +inf, NaN), beside maxima of 0, +-inf, NaN and
    spread normals.  Control: the tail taken without ``safe_shift`` (an infinite max added as it
    is) gives other bytes on the rows whose max is +inf."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 casts on the GPU need sm_80 or later")
    from tpinv.kernels import triton_softmax_combine
    rows = 1 << 24
    gen = torch.Generator().manual_seed(61)
    maxima = (30 * torch.randn(rows, generator=gen)).to(DEV)
    maxima[::7] = 0.0
    maxima[1::97] = float("inf")
    maxima[2::97] = float("-inf")
    maxima[3::97] = float("nan")
    slots = torch.zeros(rows, 4, dtype=torch.int64, device=DEV)   # two maxima words, two sums
    slots[:, 3] = 1 << 32                                         # the second leaf's sum: +0
    total = torch.empty(rows, device=DEV)
    one, two_to_32 = 0x3F800000, 0x4F800000                       # the bits of 1.0 and 2**32
    for start in list(range(one, two_to_32, rows)) + [None]:
        if start is None:                  # 0, +inf and NaN beside totals of 1
            t = torch.full((rows,), 1.0, device=DEV)
            t[:3] = torch.tensor([0.0, float("inf"), float("nan")])
        else:
            t = torch.arange(start, start + rows, dtype=torch.int32, device=DEV).view(torch.float32)
        slots[:, 2] = (t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (1 << 32)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            lse = torch.empty(rows, dtype=dtype, device=DEV)
            triton_softmax_combine.combine_sums(slots, maxima, total, 2, lse)
            assert_same_bits(total, t + 0.0, f"totals from bits {start}")   # NaN as an add's
            assert_same_bits(lse, logsumexp_from_parts(maxima, total).to(dtype),
                             f"totals from bits {start}, {dtype}")
    assert_bits_differ((maxima + torch.log(t))[1::97], logsumexp_from_parts(maxima, t)[1::97],
                       "control: an infinite max added without safe_shift")
