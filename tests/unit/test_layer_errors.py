"""Parallel layers refuse what they cannot keep invariant, with messages that say what to change."""
import types

import pytest
import torch

from tpinv.core.contract import InvarianceError
from tpinv.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy


def cfg(**kw):
    base = dict(params_dtype=torch.float32, perform_initialization=True, use_cpu_initialization=True)
    base.update(kw)
    return types.SimpleNamespace(**base)


def init(w):
    return torch.nn.init.normal_(w, 0, 0.1)


def test_sizes_not_divisible_by_leaves():
    with pytest.raises(InvarianceError, match=r"output_size=12 is not divisible by leaves=8"):
        ColumnParallelLinear(16, 12, config=cfg(), init_method=init)
    with pytest.raises(InvarianceError, match=r"input_size=20 is not divisible by leaves=8"):
        RowParallelLinear(20, 16, config=cfg(), init_method=init, bias=False, input_is_parallel=True,
                          skip_bias_add=False)
    with pytest.raises(InvarianceError, match=r"num_embeddings=100 is not divisible by leaves=8"):
        VocabParallelEmbedding(100, 16, init_method=init, config=cfg())


def test_leaves_must_be_power_of_two():
    with pytest.raises(InvarianceError, match="power of two"):
        ColumnParallelLinear(16, 24, config=cfg(), init_method=init, leaves=3)


@pytest.mark.parametrize("kw", [dict(keep_master_weight_for_test=True), dict(is_expert=True),
                                dict(embedding_activation_buffer=[]), dict(stride=3)])
def test_unsupported_keywords_name_the_keyword(kw):
    name = next(iter(kw))
    with pytest.raises(NotImplementedError, match=name):
        ColumnParallelLinear(16, 16, config=cfg(), init_method=init, **kw)


@pytest.mark.parametrize("field", ["gradient_accumulation_fusion", "sequence_parallel"])
def test_unsupported_config_fields(field):
    with pytest.raises(NotImplementedError, match=field):
        RowParallelLinear(16, 16, config=cfg(**{field: True}), init_method=init, bias=False,
                          input_is_parallel=True, skip_bias_add=False)


@pytest.mark.parametrize("kw", [dict(bias=True), dict(strategy="column_only"), dict(input_is_parallel=False)])
def test_sequence_parallel_row_layer_limits(kw):
    args = {**dict(bias=False, input_is_parallel=True, skip_bias_add=False), **kw}
    with pytest.raises(NotImplementedError, match="sequence_parallel=True"):
        RowParallelLinear(16, 16, config=cfg(sequence_parallel=True, tpinv_sequence_dim=0), init_method=init,
                          **args)


def test_unknown_row_strategy():
    with pytest.raises(ValueError, match="strategy 'ring'"):
        RowParallelLinear(16, 16, config=cfg(), init_method=init, bias=False, input_is_parallel=True,
                          skip_bias_add=False, strategy="ring")


def test_wrong_input_width_and_weight_shape():
    layer = ColumnParallelLinear(16, 8, config=cfg(), init_method=init)
    with pytest.raises(ValueError, match="expected 16"):
        layer(torch.randn(2, 12))
    with pytest.raises(ValueError, match=r"expected \(8, 16\)"):
        layer(torch.randn(2, 16), weight=torch.randn(8, 8))
    tied = ColumnParallelLinear(16, 8, config=cfg(), init_method=init, skip_weight_param_allocation=True)
    with pytest.raises(RuntimeError, match="pass weight="):
        tied(torch.randn(2, 16))


def test_embedding_bad_ids():
    emb = VocabParallelEmbedding(16, 8, init_method=init, config=cfg())
    with pytest.raises(IndexError, match="token id 16 is outside"):
        emb(torch.tensor([[1, 16]]))
    with pytest.raises(TypeError, match="int64"):
        emb(torch.tensor([[1.0]]))


def test_cross_entropy_bad_input():
    with pytest.raises(NotImplementedError, match="label_smoothing"):
        vocab_parallel_cross_entropy(torch.randn(2, 16), torch.tensor([1, 2]), 0.1)
    with pytest.raises(ValueError, match=r"expected \(2,\)"):
        vocab_parallel_cross_entropy(torch.randn(2, 16), torch.tensor([[1, 2]]))


def test_group_none_refused_when_distributed_is_initialised(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(InvarianceError, match="pass the process group explicitly"):
        ColumnParallelLinear(16, 16, config=cfg(), init_method=init)


def test_tp_group_larger_than_leaves(monkeypatch):
    import tpinv.layers.linear as linear
    monkeypatch.setattr(linear, "group_size_rank", lambda group: (16, 0))
    with pytest.raises(InvarianceError, match="group size 16 does not divide leaves=8"):
        ColumnParallelLinear(16, 16, config=cfg(), init_method=init, tp_group=object())


def test_megatron_swap_refuses_transformer_engine_modules():
    pytest.importorskip("megatron.core")
    from tpinv.megatron import swap_to_tpinv

    TELayerNormColumnParallelLinear = type("TELayerNormColumnParallelLinear", (torch.nn.Module,), {})
    model = torch.nn.Sequential(torch.nn.Module())
    model.decoder = torch.nn.Module()
    model.decoder.linear_qkv = TELayerNormColumnParallelLinear()
    with pytest.raises(NotImplementedError, match=r"decoder.linear_qkv is .*TELayerNormColumnParallelLinear.*supported"):
        swap_to_tpinv(model, tp_group=None, config=cfg())


def test_megatron_spec_refuses_moe():
    pytest.importorskip("megatron.core")
    from tpinv.megatron import get_gpt_layer_tpinv_spec

    with pytest.raises(NotImplementedError, match="num_experts"):
        get_gpt_layer_tpinv_spec(num_experts=8)


def test_a_strided_layer_names_the_group_size_as_given(monkeypatch):
    import tpinv.layers.linear as linear
    monkeypatch.setattr(linear, "group_size_rank", lambda group: (3, 0))   # a group of three ranks
    with pytest.raises(InvarianceError, match=r"group size 3 is not a power of two.* leaves=8 "):
        ColumnParallelLinear(64, 128, config=cfg(), init_method=init, stride=2, tp_group=object())
    monkeypatch.setattr(linear, "group_size_rank", lambda group: (2, 0))   # the control: two ranks build
    ColumnParallelLinear(64, 128, config=cfg(), init_method=init, stride=2, tp_group=object())
