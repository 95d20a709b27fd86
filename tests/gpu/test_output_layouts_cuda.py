"""tests/unit/test_output_layouts.py's checks on CUDA: the Triton rope and attention kernels
(forward and backward, dense and packed) write their outputs in the layout the fakes declare,
with the bytes a contiguous input gives."""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_output_layouts import check_attention, check_rope

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("packed", [False, True])
def test_attention_outputs_in_the_inputs_layout(packed):
    check_attention("cuda", packed)


def test_rope_outputs_in_the_inputs_layout():
    check_rope("cuda")
