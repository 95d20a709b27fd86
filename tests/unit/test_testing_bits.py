"""``tpinv.testing``'s byte check: shape, dtype and raw bytes, for tensors of any strides.

Controls by construction: ``0.0`` vs ``-0.0`` differ (equal as numbers), one NaN
payload vs another differs, and a differing element is named.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.testing import assert_bits_differ, assert_same_bits, bits, same_bits


def test_signed_zero_and_nan_payloads_are_bits():
    assert_bits_differ(torch.tensor([0.0]), torch.tensor([-0.0]), "0.0 vs -0.0")
    a = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert_bits_differ(a[:1], a[1:], "two NaN payloads")
    assert_same_bits(a, a.clone(), "a NaN tensor and its copy")


@pytest.mark.parametrize("view", ["size1_stride4", "transposed", "zero_dim", "empty"])
def test_any_strides_compare_by_their_row_major_bytes(view):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = {"size1_stride4": x[:1, 0],          # one element, stride 4: contiguous() keeps it
         "transposed": x.t(),
         "zero_dim": x[1, 2],
         "empty": x[:0]}[view]
    same = t.contiguous().clone()
    assert_same_bits(t, same, view)
    assert same_bits(t, same) and bits(t) == bits(same)
    if t.numel():
        other = same.clone()
        other.view(-1)[-1] += 1
        assert_bits_differ(t, other, f"{view}, last element changed")


def test_mismatches_are_named():
    x = torch.zeros(2, 3)
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_same_bits(x, torch.zeros(3, 2))
    with pytest.raises(AssertionError, match="dtypes differ"):
        assert_same_bits(x, x.double())
    y = x.clone()
    y[1, 2] = 1.0
    with pytest.raises(AssertionError, match=r"1 of 6 elements differ; first at index \[1, 2\]"):
        assert_same_bits(x, y, "x")
