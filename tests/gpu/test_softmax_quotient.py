"""Softmax's quotient from the row's reciprocal is ``div_rn``'s, bit for bit, wherever it runs.

:func:`tpinv.kernels.gluon_softmax_leaf.quotient_by_reciprocal` (``q = a * y``, two corrections
``q + (a - b * q) * y``, ``y = div_rn(1, b)``) replaces ``div_rn(a, b)`` in the held softmax
where :func:`~tpinv.kernels.gluon_softmax_leaf.reciprocal_divides_exactly` holds: ``b`` (the row
total) in ``[1, 2**24)`` of exponent ``t`` and every ``a`` (an exp) above ``2**(t - 97)``.  Here
both run on the GPU over every fp32 ``a`` of whole binades -- ``[2**(t - 97), 2**(t - 96))``, the
lowest the guard admits; ``[2**-40, 2**-39)``; ``[0.5, 1)``; ``[1, 2)`` (holding ``a = 1``) --
for totals at the edges (1, the float after 1, just under 2, 2**24 minus one ulp), small odd ones
(3, 7) and 48 drawn from ``[1, 2**18)``: no bit differs.  Control: the quotient without its
corrections (``a * y``, one rounding after the reciprocal's) differs from ``div_rn`` in millions
of the same pairs (at ``b = 3`` a third of a binade), so the comparison sees a wrong quotient.
Skips without an sm_90 GPU and a Triton with Gluon.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BINADE = 1 << 23
BLOCK = 4096


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from tpinv.kernels.gluon_softmax_leaf import quotient_by_reciprocal
except ImportError:             # a Triton without Gluon: the tests skip
    gluon = None

if gluon is not None:
    @gluon.jit
    def count_differences(pairs_ptr, bad_ptr, BLOCK: gl.constexpr, CORRECTED: gl.constexpr,
                          num_warps: gl.constexpr):
        """Over the pair ``program_id(1)`` (a total's bits, the first ``a``'s bits), how many of
        ``BLOCK`` consecutive ``a`` give a quotient whose bits differ from ``div_rn``'s."""
        layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
        pair = pairs_ptr + 2 * gl.program_id(1)
        b = gl.load(pair).to(gl.float32, bitcast=True)
        bits = gl.load(pair + 1) + gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
        a = bits.to(gl.float32, bitcast=True)
        y = gl.div_rn(1.0, b)
        if CORRECTED:
            got = quotient_by_reciprocal(a, b, y)
        else:
            got = a * y
        want = gl.div_rn(a, b)
        differs = got.to(gl.int32, bitcast=True) != want.to(gl.int32, bitcast=True)
        gl.atomic_add(bad_ptr + gl.program_id(1), gl.sum(differs.to(gl.int32), axis=0))


def _check_device():
    if gluon is None:
        pytest.skip("needs a Triton with Gluon")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the held softmax runs on sm_90 only")


def _totals() -> torch.Tensor:
    edges = torch.tensor([1.0, 1.0 + 2 ** -23, 2.0 - 2 ** -23, 2.0 ** 24 - 1.0, 3.0, 7.0])
    gen = torch.Generator().manual_seed(0)
    drawn = torch.exp2(torch.rand(48, generator=gen, dtype=torch.float64) * 18).float()
    return torch.cat([edges, drawn])


def _pairs(totals: torch.Tensor) -> torch.Tensor:
    """(total bits, first a's bits) for each binade of ``a`` checked with each total."""
    bits = totals.view(torch.int32)
    t = (bits >> 23) - 127                                    # the total's exponent
    binades = [t - 97, torch.full_like(t, -40), torch.full_like(t, -1), torch.zeros_like(t)]
    return torch.stack([torch.stack([bits, (e + 127) << 23], 1) for e in binades], 1).reshape(-1, 2)


def _differences(corrected: bool, totals: torch.Tensor) -> torch.Tensor:
    _check_device()
    pairs = _pairs(totals).cuda()
    bad = torch.zeros(pairs.shape[0], dtype=torch.int32, device="cuda")
    grid = (BINADE // BLOCK, pairs.shape[0])
    count_differences[grid](pairs, bad, BLOCK=BLOCK, CORRECTED=corrected, num_warps=4,
                            enable_fp_fusion=False)
    return bad.cpu()


def test_the_quotient_from_the_reciprocal_is_div_rn():
    totals = _totals()
    bad = _differences(True, totals)
    assert bad.shape[0] == 4 * totals.numel()
    assert int(bad.sum()) == 0, [(float(totals[i // 4]), i % 4, int(n))
                                 for i, n in enumerate(bad) if n]


def test_control_the_uncorrected_quotient_differs():
    totals = torch.tensor([3.0])
    bad = _differences(False, totals)
    # a * RN(1/3) misses RN(a/3) for a third of the binade [0.5, 1) (2,796,202 of 8,388,608)
    assert int(bad[2]) > BINADE // 4, bad.tolist()
