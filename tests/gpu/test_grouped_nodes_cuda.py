"""Grouped autograd nodes on CUDA: a training step of a Qwen3-0.6B-shaped model (two layers) with q/k/v
and gate/up as one node each (``column_parallel_group``) and the q/k norms and rotary embedding as one
(``norm_and_rope``) has the bits of the same step with every layer called on its own (the autograd
engine's device thread adds the separate nodes' input gradients).  ``tests/unit/test_linear_group.py``
and ``tests/unit/test_query_key.py`` hold the CPU checks and the controls."""
from __future__ import annotations

import pytest
import torch

from tpinv.layers.linear import grouped_calls
from tpinv.layers.query_key import grouped_norm_rope_calls
from tpinv.models import Transformer, get_config
from tpinv.testing import assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _step(one_by_one: bool):
    torch.manual_seed(0)
    model = Transformer(get_config("qwen3-0.6b", num_layers=2, vocab_size=4096, dtype=torch.bfloat16)).cuda()
    hooks = 0
    if one_by_one:
        for layer in model.layers:
            for module in (layer.self_attn.v_proj, layer.mlp.gate_proj, layer.self_attn.k_norm):
                module.register_forward_hook(lambda *a: None)
                hooks += 1
    tokens = torch.randint(0, 4096, (2, 512), generator=torch.Generator().manual_seed(1)).cuda()
    before = grouped_calls(), grouped_norm_rope_calls()
    loss = model.loss(tokens, tokens.roll(1, 1)).mean()
    loss.backward()
    ran = grouped_calls() - before[0], grouped_norm_rope_calls() - before[1]
    return [loss.detach()] + [p.grad for p in model.parameters()], ran, hooks


def test_grouped_step_has_the_bits_of_one_node_per_call_on_cuda():
    grouped, ran, _ = _step(False)
    assert ran == (4, 2)
    one_by_one, ran_alone, hooks = _step(True)
    assert ran_alone == (0, 0) and hooks == 6
    for i, (a, b) in enumerate(zip(grouped, one_by_one)):
        assert_same_bits(a, b, f"tensor {i}")
