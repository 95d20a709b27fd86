"""megatron-core integration: a GPT ``ModuleSpec`` with tpinv layers, and an in-place swap.

Invariant kept: a megatron-core ``GPTModel`` (local spec) whose linears, embedding, output
layer, loss and dropouts are tpinv's gives the same logits, loss and gradient bits at every TP
size and thread count.  The norms are :mod:`tpinv.megatron.norms`' (their weight and bias
gradients sum tokens in one fixed order; torch's split the tokens among threads); the rest of
the local spec (rotary and learned position embeddings, core attention) is elementwise,
per-head or a per-row sum in token order, so it sees identical inputs and shapes at every TP
size; a bias megatron adds itself (``skip_bias_add``) has its gradient summed in a fixed order
(:mod:`tpinv.megatron.layers`).  Dropout is
:mod:`tpinv.megatron.dropout`'s.  megatron-core 0.12 through 0.16 are supported
(:mod:`tpinv.megatron.version`).  Transformer-Engine, apex and Kitchen modules are not
invariant: they are detected and refused with a message listing what is supported.

megatron-core is imported lazily; importing tpinv never imports it.
"""
from __future__ import annotations

import types
from typing import Any, Optional

import torch

from tpinv.layers import vocab_parallel_cross_entropy
from tpinv.megatron.dropout import install_invariant_dropout
from tpinv.core.contract import DEFAULT_LEAVES
from tpinv.megatron.layers import (
    LEAVES_FIELD, MegatronColumnParallelLinear, MegatronRowParallelLinear, MegatronVocabParallelEmbedding,
    megatron_tp_group,
)
from tpinv.megatron.norms import NORM_TYPES, InvariantNorm
from tpinv.megatron.version import megatron_version

SUPPORTED = ("megatron.core.tensor_parallel.ColumnParallelLinear", "megatron.core.tensor_parallel.RowParallelLinear",
             "megatron.core.tensor_parallel.VocabParallelEmbedding", "local-spec norms and DotProductAttention")


def _mcore():
    try:
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("tpinv.megatron needs megatron-core: pip install 'tpinv[megatron]'") from e
    megatron_version()
    return tensor_parallel, get_gpt_layer_local_spec


def _refuse_transformer_engine(module: torch.nn.Module, where: str) -> None:
    cls = type(module)
    origin = f"{cls.__module__}.{cls.__name__}"
    if ("transformer_engine" in origin or cls.__name__.startswith("TE") or "kitchen" in origin or "apex" in origin
            or cls.__name__ == "FusedLayerNorm"):
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
    attn.linear_qkv, attn.linear_proj = MegatronColumnParallelLinear, MegatronRowParallelLinear
    mlp.linear_fc1, mlp.linear_fc2 = MegatronColumnParallelLinear, MegatronRowParallelLinear
    return spec


def _gated_fc1(where: str, config) -> bool:
    return where.endswith("mlp.linear_fc1") and bool(getattr(config, "gated_linear_unit", False))


def _column_from(old, config, tp_group, where) -> MegatronColumnParallelLinear:
    stride = getattr(old.weight, "partition_stride", 1) or 1
    new = MegatronColumnParallelLinear(
        old.input_size, old.output_size, config=config, init_method=None, bias=old.bias is not None,
        gather_output=old.gather_output, skip_bias_add=old.skip_bias_add,
        skip_weight_param_allocation=old.weight is None, stride=2 if _gated_fc1(where, config) else stride,
        tp_group=tp_group)
    if _gated_fc1(where, config) and stride == 1 and old.weight is not None:
        _restride_gated(old, tp_group)
    return new


def _restride_gated(old, tp_group) -> None:
    """megatron-core < 0.16 draws a gated fc1 as one ``[2F, H]`` master cut in TP blocks, read
    per rank as ``[gate_r; up_r]`` -- a different function at each TP.  Gather the master (the
    same draw at every TP) and keep the stride-2 slices, i.e. ``gate = master[:F]``,
    ``up = master[F:]`` at every TP size (the TP=1 model's function)."""
    import torch.distributed as dist
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    if tp == 1:
        return
    parts = [torch.empty_like(old.weight) for _ in range(tp)]
    dist.all_gather(parts, old.weight.detach().contiguous(), group=tp_group)
    master, rank = torch.cat(parts), dist.get_rank(tp_group)
    block = master.shape[0] // (2 * tp)
    with torch.no_grad():
        old.weight.copy_(torch.cat(master.split(block)[rank::tp]))
        if old.bias is not None:
            bparts = [torch.empty_like(old.bias) for _ in range(tp)]
            dist.all_gather(bparts, old.bias.detach().contiguous(), group=tp_group)
            old.bias.copy_(torch.cat(torch.cat(bparts).split(block)[rank::tp]))


def _row_from(old, config, tp_group, where) -> MegatronRowParallelLinear:
    return MegatronRowParallelLinear(
        old.input_size, old.output_size, config=config, init_method=None, bias=old.bias is not None,
        input_is_parallel=old.input_is_parallel, skip_bias_add=old.skip_bias_add, tp_group=tp_group,
        strategy="tree")


def _norm_from(old, config, tp_group, where) -> InvariantNorm:
    return InvariantNorm.from_torch(old)


def _embedding_from(old, config, tp_group, where) -> MegatronVocabParallelEmbedding:
    return MegatronVocabParallelEmbedding(old.num_embeddings, old.embedding_dim, init_method=None, config=config,
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


def swap_to_tpinv(model: torch.nn.Module, *, tp_group: Optional[torch.distributed.ProcessGroup] = None,
                  config: Any = None, dropout_seed: Optional[int] = None) -> torch.nn.Module:
    """Replace, in place, every megatron-core tensor-parallel linear and embedding of ``model``
    (a ``GPTModel`` built from the local spec, or any module tree of them) with tpinv's, and every
    torch LayerNorm / RMSNorm with :class:`~tpinv.megatron.norms.InvariantNorm`, keeping the
    weights; route the model's language-model loss through tpinv's cross-entropy.

    ``tp_group`` must be the group the model was built with (``None``: megatron's
    ``parallel_state`` TP group).  Every dropout becomes :mod:`tpinv.megatron.dropout`'s, keyed by
    ``dropout_seed`` (default ``torch.initial_seed()``).  Returns ``model``.
    """
    tensor_parallel, _ = _mcore()
    tp_group = megatron_tp_group(tp_group)
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError("swap_to_tpinv needs the model's TransformerConfig (model.config or config=)")
    makers = ((tensor_parallel.ColumnParallelLinear, _column_from), (tensor_parallel.RowParallelLinear, _row_from),
              (tensor_parallel.VocabParallelEmbedding, _embedding_from)) + \
        tuple((cls, _norm_from) for cls in NORM_TYPES)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            where = f"{parent_name}.{child_name}".lstrip(".")
            _refuse_transformer_engine(child, where)
            for cls, make in makers:
                if type(child) is cls:
                    new = make(child, config, tp_group, where)
                    _copy_params(child, new)
                    setattr(parent, child_name, new.to(next(child.parameters(), torch.empty(0)).device))
                    break
    if hasattr(model, "compute_language_model_loss"):
        model._tpinv_tp_group = tp_group
        model._tpinv_leaves = getattr(config, LEAVES_FIELD, None) or DEFAULT_LEAVES
        model.compute_language_model_loss = types.MethodType(_tpinv_language_model_loss, model)
    seed = torch.initial_seed() if dropout_seed is None else dropout_seed
    install_invariant_dropout(model, tp_group=tp_group, seed=seed & 0xFFFFFFFF)
    return model


def build_gpt_model(config: Any, *, tp_group=None, vocab_size: int, max_sequence_length: int,
                    spec_kwargs: Optional[dict] = None, dropout_seed: Optional[int] = None, **gpt_kwargs: Any) -> torch.nn.Module:
    """A megatron-core ``GPTModel`` from :func:`get_gpt_layer_tpinv_spec`, its embedding, output
    layer and loss swapped to tpinv's as well."""
    from megatron.core.models.gpt import GPTModel

    spec = get_gpt_layer_tpinv_spec(**(spec_kwargs or {}))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                     max_sequence_length=max_sequence_length, **gpt_kwargs)
    return swap_to_tpinv(model, tp_group=tp_group, config=config, dropout_seed=dropout_seed)
