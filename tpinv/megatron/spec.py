"""megatron-core integration: a GPT ``ModuleSpec`` with tpinv layers, and an in-place swap.

Invariant kept: a megatron-core ``GPTModel`` (local spec) whose linears, embedding, output
layer and loss are tpinv's gives the same logits and loss bits at every TP size.  The rest
of the local spec (RMSNorm, rotary embedding, core attention) is elementwise or per-head and
sees identical inputs at every TP size.  Transformer-Engine, apex and Kitchen modules are not
invariant: they are detected and refused with a message listing what is supported.

megatron-core is imported lazily; importing tpinv never imports it.
"""
from __future__ import annotations

import types
from typing import Any, Optional

import torch

from tpinv.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy

SUPPORTED = ("megatron.core.tensor_parallel.ColumnParallelLinear", "megatron.core.tensor_parallel.RowParallelLinear",
             "megatron.core.tensor_parallel.VocabParallelEmbedding", "local-spec norms and DotProductAttention")


def _mcore():
    try:
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("tpinv.megatron needs megatron-core: pip install 'tpinv[megatron]'") from e
    return tensor_parallel, get_gpt_layer_local_spec


def _refuse_transformer_engine(module: torch.nn.Module, where: str) -> None:
    cls = type(module)
    origin = f"{cls.__module__}.{cls.__name__}"
    if "transformer_engine" in origin or cls.__name__.startswith("TE") or "kitchen" in origin or "apex" in origin:
        raise NotImplementedError(
            f"{where} is {origin}, a Transformer-Engine/apex/Kitchen module, which tpinv cannot make invariant. "
            f"Build the model with tpinv.megatron.get_gpt_layer_tpinv_spec() (or the local spec) instead; "
            f"supported: {', '.join(SUPPORTED)}")


def get_gpt_layer_tpinv_spec(**local_spec_kwargs: Any):
    """megatron-core's local GPT layer spec with tpinv's linears in linear_qkv/proj/fc1/fc2.

    Keyword arguments go to ``get_gpt_layer_local_spec`` (e.g. ``normalization="RMSNorm"``,
    ``qk_layernorm=True``).  MoE and multi-latent attention are refused.
    """
    _, get_local = _mcore()
    for key in ("num_experts", "multi_latent_attention", "use_kitchen"):
        if local_spec_kwargs.get(key):
            raise NotImplementedError(f"get_gpt_layer_tpinv_spec: {key} is not supported")
    spec = get_local(**local_spec_kwargs)
    attn = spec.submodules.self_attention.submodules
    mlp = spec.submodules.mlp.submodules
    attn.linear_qkv, attn.linear_proj = ColumnParallelLinear, RowParallelLinear
    mlp.linear_fc1, mlp.linear_fc2 = ColumnParallelLinear, RowParallelLinear
    return spec


def _column_from(old, config, tp_group) -> ColumnParallelLinear:
    new = ColumnParallelLinear(
        old.input_size, old.output_size, config=config, init_method=None, bias=old.bias is not None,
        gather_output=old.gather_output, skip_bias_add=old.skip_bias_add,
        skip_weight_param_allocation=old.weight is None, stride=getattr(old.weight, "partition_stride", 1) or 1,
        tp_group=tp_group)
    return new


def _row_from(old, config, tp_group) -> RowParallelLinear:
    return RowParallelLinear(
        old.input_size, old.output_size, config=config, init_method=None, bias=old.bias is not None,
        input_is_parallel=old.input_is_parallel, skip_bias_add=old.skip_bias_add, tp_group=tp_group,
        strategy="tree")


def _embedding_from(old, config, tp_group) -> VocabParallelEmbedding:
    return VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, init_method=None, config=config,
                                  tp_group=tp_group)


def _copy_params(old: torch.nn.Module, new: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in new.named_parameters(recurse=False):
            src = getattr(old, name)
            if src is None or tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"cannot carry {name}: shape {None if src is None else tuple(src.shape)} "
                                 f"vs {tuple(p.shape)}")
            p.copy_(src)
            for attr in ("shared", "allreduce", "sequence_parallel"):
                if hasattr(src, attr):
                    setattr(p, attr, getattr(src, attr))


def _tpinv_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` per-token loss from ``[s, b, V/C]`` logits, through tpinv's cross-entropy."""
    labels = labels.transpose(0, 1).contiguous()
    loss = vocab_parallel_cross_entropy(logits, labels, tp_group=self._tpinv_tp_group, leaves=self._tpinv_leaves)
    return loss.transpose(0, 1).contiguous()


def swap_to_tpinv(model: torch.nn.Module, *, tp_group: Optional[torch.distributed.ProcessGroup],
                  config: Any = None) -> torch.nn.Module:
    """Replace, in place, every megatron-core tensor-parallel linear and embedding of ``model``
    (a ``GPTModel`` built from the local spec, or any module tree of them) with tpinv's, keeping
    the weights; route the model's language-model loss through tpinv's cross-entropy.

    ``tp_group`` must be the group the model was built with.  Returns ``model``.
    """
    tensor_parallel, _ = _mcore()
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError("swap_to_tpinv needs the model's TransformerConfig (model.config or config=)")
    makers = ((tensor_parallel.ColumnParallelLinear, _column_from), (tensor_parallel.RowParallelLinear, _row_from),
              (tensor_parallel.VocabParallelEmbedding, _embedding_from))
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            where = f"{parent_name}.{child_name}".lstrip(".")
            _refuse_transformer_engine(child, where)
            for cls, make in makers:
                if type(child) is cls:
                    new = make(child, config, tp_group)
                    _copy_params(child, new)
                    setattr(parent, child_name, new.to(next(child.parameters(), torch.empty(0)).device))
                    break
    if hasattr(model, "compute_language_model_loss"):
        model._tpinv_tp_group = tp_group
        model._tpinv_leaves = getattr(config, "tpinv_leaves", None) or 8
        model.compute_language_model_loss = types.MethodType(_tpinv_language_model_loss, model)
    return model


def build_gpt_model(config: Any, *, tp_group, vocab_size: int, max_sequence_length: int,
                    spec_kwargs: Optional[dict] = None, **gpt_kwargs: Any) -> torch.nn.Module:
    """A megatron-core ``GPTModel`` from :func:`get_gpt_layer_tpinv_spec`, its embedding, output
    layer and loss swapped to tpinv's as well."""
    from megatron.core.models.gpt import GPTModel

    spec = get_gpt_layer_tpinv_spec(**(spec_kwargs or {}))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                     max_sequence_length=max_sequence_length, **gpt_kwargs)
    return swap_to_tpinv(model, tp_group=tp_group, config=config)
