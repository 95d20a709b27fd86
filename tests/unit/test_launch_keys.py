"""The bound-launch key (tpinv.kernels.launch): host TMA descriptors are keyed by what Triton
compiles them by (dtype, block shape) and never by what it does not (address, shape, strides),
so a bound launcher is reused across calls whose descriptors differ only in those -- and never
across descriptors Triton would compile apart.  CPU only: the key is host code."""
from __future__ import annotations

import pytest
import torch

from tpinv.kernels import launch

TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor


def desc(t, block):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def test_descriptors_are_keyed_by_dtype_and_block_shape():
    a = torch.empty(2, 4, 128, 64, dtype=torch.bfloat16)
    b = torch.empty(3, 4, 300, 64, dtype=torch.bfloat16)[:, :, 7:]    # other address, shape, strides
    key = launch._specialization((desc(a, [1, 1, 64, 64]), 5))
    assert launch._specialization((desc(b, [1, 1, 64, 64]), 5)) == key
    assert launch._specialization((desc(a, [1, 1, 32, 64]), 5)) != key, "control: another block shape"
    assert launch._specialization((desc(a.half(), [1, 1, 64, 64]), 5)) != key, "control: another dtype"


def test_unknown_argument_kinds_still_raise():
    with pytest.raises(TypeError):
        launch._specialization((object(),))
