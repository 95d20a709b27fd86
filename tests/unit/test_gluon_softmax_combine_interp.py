"""The held softmax's statistics combine (:func:`tpinv.kernels.triton_softmax_combine._combine_sums`) under
Triton's interpreter (CPU tensors), bitwise.

The statistics' launch publishes each leaf sum as a 64-bit word (its fp32 bits and a written
flag); the combine kernel takes each row's total from those words.  Checked: the total is
``tree_combine`` of the published sums (the adjacent-pair tree), raw bytes, for 2, 4 and 8 leaves,
the flag bit never reaching the value.  Control, by construction: a row of ``2^24, 1, 1, -2^24``
sums to 1 in the pair tree and to 0 left to right, and the kernel gives 1.  The whole held kernel
is compared with the row kernel on a GPU (``tests/gpu/test_softmax_by_leaves.py``).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from triton_interp import interpreted_test, main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
# run where the held kernels it serves can run (a Triton with Gluon), as before the combine had its own module
pytest.importorskip("tpinv.kernels.gluon_softmax", reason="needs a Triton with Gluon", exc_type=ImportError)


def published(sums: torch.Tensor) -> torch.Tensor:
    """The slots a statistics launch leaves: per row ``L`` maxima words (unused here), then ``L``
    sum words of ``(1 << 32) | fp32 bits``."""
    rows, leaves = sums.shape
    slots = torch.zeros(rows, 2 * leaves, dtype=torch.int64)
    slots[:, leaves:] = (sums.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (1 << 32)
    return slots


def _check_combine_is_the_pair_tree():
    from tpinv.core.contract import tree_combine
    from tpinv.kernels import triton_softmax_combine
    from tpinv.testing import assert_bits_differ, assert_same_bits

    gen = torch.Generator().manual_seed(17)
    for leaves in (2, 4, 8):
        sums = torch.exp(6 * torch.randn(9, leaves, generator=gen))
        sums[1, 0] = float("inf")
        total = torch.full((9,), float("nan"))
        triton_softmax_combine._combine_sums[(9,)](published(sums), total, total, total, LEAVES=leaves,
                                          LOG2_LEAVES=leaves.bit_length() - 1, LSE=False)
        assert_same_bits(total, tree_combine(sums), f"{leaves} leaves")
    control = torch.tensor([[2.0 ** 24, 1.0, 1.0, -2.0 ** 24]])
    total = torch.empty(1)
    triton_softmax_combine._combine_sums[(1,)](published(control), total, total, total, LEAVES=4,
                                      LOG2_LEAVES=2, LSE=False)
    assert total.item() == 1.0 and control.sum().item() == 0.0
    assert_bits_differ(total, control.sum(-1), "control: the pair tree against left to right")


CHECKS = {name[1:]: fn for name, fn in dict(globals()).items() if name.startswith("_check_")}
test_interpreted = interpreted_test(__file__, CHECKS)

if __name__ == "__main__":
    main(CHECKS)
