"""Column-parallel layers of one input as one autograd node (``column_parallel_group``): the bits of
one node per layer.

Byte-level checks (``assert_same_bits``) of a whole training step -- loss, every parameter's
gradient -- with the group against the same step with the layers called one by one (forced by a
no-op forward hook on one layer of each group, which the group must respect), and of the input
gradient's order of adds against the autograd engine's, with a control whose values make another
order differ by construction.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.layers import ColumnParallelLinear, column_parallel_group
from tpinv.layers.linear import grouped_calls
from tpinv.models import get_config
from tpinv.testing import assert_bits_differ, assert_same_bits

from model_steps import random_model, step_tensors


def _step(name: str, dtype: torch.dtype, one_by_one: bool, **overrides):
    model = random_model(name, dtype, **overrides)
    hooked = []
    if one_by_one:
        for layer in model.layers:
            hooked.append(layer.self_attn.k_proj.register_forward_hook(lambda *a: hooked.append(1)))
            hooked.append(layer.mlp.up_proj.register_forward_hook(lambda *a: hooked.append(1)))
    before = grouped_calls()
    tensors = step_tensors(model)
    return tensors, grouped_calls() - before, sum(1 for h in hooked if h == 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name,overrides", [("qwen3-tiny", {}), ("qwen3-kv2-tiny", {}),
                                            ("qwen3-tiny", {"attention_bias": True})],
                         ids=["qwen3", "kv2", "bias"])
def test_grouped_step_has_the_bits_of_one_node_per_layer(name, overrides, dtype):
    grouped, ran, _ = _step(name, dtype, False, **overrides)
    layers = get_config(name).num_layers
    assert ran == 2 * layers                 # q/k/v and gate/up of every layer ran as one node each
    one_by_one, ran_alone, hook_calls = _step(name, dtype, True, **overrides)
    assert ran_alone == 0 and hook_calls == 2 * layers   # the hooks ran: the layers were called
    for i, (a, b) in enumerate(zip(grouped, one_by_one)):
        assert_same_bits(a, b, f"tensor {i}")


def _layers(n: int, bias: bool = False) -> list[ColumnParallelLinear]:
    config = type("Config", (), {"use_cpu_initialization": True, "params_dtype": torch.bfloat16})()
    return [ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.zeros_, bias=bias,
                                 leaves=1) for _ in range(n)]


def test_input_gradient_adds_as_the_engine_does():
    """dX[0, 0] gets 1 from the first layer and 2^-8 from each other one.  The engine adds the
    last-created layer's first and the first layer's last: (2^-8 + 2^-8) + 1 = 1 + 2^-7.
    Control: the first layer's first, 1 + 2^-8 + 2^-8, rounds to 1 at each bf16 add."""
    layers = _layers(3)
    with torch.no_grad():
        for layer, value in zip(layers, (1.0, 2.0 ** -8, 2.0 ** -8)):
            layer.weight[0, 0] = value
    dy = torch.zeros(1, 8, dtype=torch.bfloat16)
    dy[0, 0] = 1

    def input_grad(grouped: bool) -> torch.Tensor:
        x = torch.ones(1, 8, dtype=torch.bfloat16, requires_grad=True)
        before = grouped_calls()
        outs = column_parallel_group(layers, x) if grouped else [layer(x)[0] for layer in layers]
        assert grouped_calls() - before == int(grouped)
        torch.autograd.backward(outs, [dy] * len(outs))
        return x.grad

    grouped, engine = input_grad(True), input_grad(False)
    assert grouped[0, 0].item() == 1 + 2.0 ** -7
    assert_same_bits(grouped, engine, "dX")
    first_layer_first = (layers[0].weight[0] + layers[1].weight[0]) + layers[2].weight[0]
    assert first_layer_first[0].item() == 1.0
    assert_bits_differ(first_layer_first.detach().view(1, 8), grouped, "another order of adds")


def test_hooks_subclasses_replaced_forwards_and_bad_shapes_take_the_layers_own_calls():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    layers = _layers(2, bias=True)
    seen = []
    layers[1].register_forward_pre_hook(lambda *a: seen.append("pre"))
    before = grouped_calls()
    outs = column_parallel_group(layers, x)
    assert seen == ["pre"] and grouped_calls() == before
    assert_same_bits(outs[1], layers[1](x)[0], "hooked layer")

    class Adapted(ColumnParallelLinear):     # e.g. an adapter wrapping the product
        pass
    other = Adapted(8, 8, config=layers[0].config, init_method=torch.nn.init.zeros_, bias=False, leaves=1)
    column_parallel_group([_layers(1)[0], other], x)
    assert grouped_calls() == before
    patched = _layers(2)                       # a forward replaced on the layer runs
    patched[0].forward = lambda inp: (torch.full((3, 8), 7.0, dtype=torch.bfloat16), None)
    assert column_parallel_group(patched, x)[0].eq(7).all() and grouped_calls() == before
    with pytest.raises(ValueError, match="last dim"):
        column_parallel_group(_layers(2), torch.randn(3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="at least one layer"):
        column_parallel_group([], x)
