"""Column-parallel layers of one input as one autograd node, on CUDA: a training step of a Qwen3-0.6B-shaped
model (two layers) has the bits of the same step with the layers called one by one (the autograd
engine's device thread adds their input gradients); ``tests/unit/test_linear_group.py`` holds the
CPU checks and the order-of-adds control."""
from __future__ import annotations

import pytest
import torch

from tpinv.layers.linear import grouped_calls
from tpinv.models import Transformer, get_config
from tpinv.testing import assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _step(one_by_one: bool):
    torch.manual_seed(0)
    model = Transformer(get_config("qwen3-0.6b", num_layers=2, vocab_size=4096, dtype=torch.bfloat16)).cuda()
    hooks = 0
    if one_by_one:
        for layer in model.layers:
            layer.self_attn.v_proj.register_forward_hook(lambda *a: None)
            layer.mlp.gate_proj.register_forward_hook(lambda *a: None)
            hooks += 2
    tokens = torch.randint(0, 4096, (2, 512), generator=torch.Generator().manual_seed(1)).cuda()
    before = grouped_calls()
    loss = model.loss(tokens, tokens.roll(1, 1)).mean()
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()], grouped_calls() - before, hooks


def test_grouped_step_has_the_bits_of_one_node_per_layer_on_cuda():
    grouped, ran, _ = _step(False)
    assert ran == 4
    one_by_one, ran_alone, hooks = _step(True)
    assert ran_alone == 0 and hooks == 4
    for i, (a, b) in enumerate(zip(grouped, one_by_one)):
        assert_same_bits(a, b, f"tensor {i}")
