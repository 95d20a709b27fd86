"""DTensor tensor-parallel plans for HF-style decoders: vanilla, column-only, invariant.

Three plans over the same module names (HF's ``model.layers.*.self_attn.q_proj`` ...; a
``tpinv.models.Transformer`` uses the same names without ``model.``):

``"default"``
    The usual Megatron-like plan with torch's styles: q/k/v/gate/up ``ColwiseParallel``,
    o_proj/down_proj ``RowwiseParallel`` (their outputs are plain all-reduces of partial
    sums, so the bits change with TP).  The negative control.
``"numerically_stable"``
    The column-only plan: o_proj/down_proj become ``ColwiseParallel(input_layouts=Shard(-1),
    output_layouts=Replicate())`` -- all-gather the input, compute an N-slice of the full
    product, all-gather the output.  The forward adds no partial sums across ranks (its one
    all-reduce is the embedding's, one rank's row plus zeros: exact); the backward does (the
    input gradient of every column layer is a plain all-reduce or reduce-scatter of partial
    sums).  It promises no bits: each rank runs torch's own kernels on a slice (a BLAS GEMM
    on an N-slice, a vectorised activation on a shorter row), which may round differently
    from the whole, so logits and gradients may change with TP.  Qwen3's q/k norm weights
    stay replicated plain tensors whose gradients cover only the rank's heads.
``"invariant"``
    The column-only layout with tpinv's styles (:mod:`tpinv.dtensor.styles`): every linear,
    the embedding and the loss run tpinv's ops and every cross-rank sum, forward and
    backward, is a tree reduction of fp32 partials; HF's RMSNorm, RoPE, SiLU and eager
    attention are swapped for tpinv's.  Logits, loss and every gradient are the same bits
    at every TP size dividing ``leaves``, and equal to ``tpinv.models.Transformer``'s.  A TP
    size above the KV heads (a multiple of them) replicates KV heads as Megatron does: k/v
    rows ``(Shard(0), Replicate())`` on the TP mesh unflattened to ``(kv, replica)``, query
    heads gathered per replica group (:mod:`tpinv.layers.kv_replication`); torch's plans
    refuse it.

Embedding: vocabulary rows sharded (``Shard(0)``), output replicated (each row lives on one
rank, so the cross-rank sum adds one value to zeros and is exact).  lm_head: column-parallel
(``Shard(0)``, tied to the embedding when the model ties them); by default its output is the
whole ``[..., V]`` gathered exactly (no cross-rank sum, and HF's own loss and generation work
unchanged); ``shard_logits=True`` keeps a ``Shard(-1)`` DTensor for a vocab-parallel loss
(:func:`cross_entropy`; a call with HF's ``labels=`` is then refused).  A tpinv Transformer keeps its own convention (local vocabulary
shard; ``model.loss`` / ``gather_logits``) and takes the invariant plan only.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                               parallelize_module)

from tpinv.core.contract import DEFAULT_LEAVES, InvarianceError, check_divisible, check_leaves
from tpinv.distributed.groups import LOCAL
from tpinv.dtensor.hf_modules import TpinvAttention, TpinvHeadRMSNorm, TpinvMLP, TpinvRMSNorm, TpinvRotary
from tpinv.dtensor.styles import (InvariantColumnOnlyParallel, InvariantColwiseParallel,
                                  InvariantVocabEmbedding, ShardedHeads, TpinvModelGroup, replica_mesh)
from tpinv.layers import vocab_parallel_cross_entropy
from tpinv.models import ModelArgs, Transformer, check_model_sizes
from tpinv.models.args import kv_replicas

__all__ = ["PLANS", "ModelLayout", "default_plan", "numerically_stable_plan", "invariant_plan", "validate",
           "parallelize", "cross_entropy"]

PLANS = ("invariant", "numerically_stable", "default")
_COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWS = ("self_attn.o_proj", "mlp.down_proj")


@dataclass(frozen=True)
class ModelLayout:
    """Where a supported model keeps its modules, and its shape."""

    kind: str            # "hf" | "tpinv"
    prefix: str          # "model." for HF's *ForCausalLM, "" for tpinv's Transformer
    args: ModelArgs


def _layout(model: nn.Module) -> ModelLayout:
    if isinstance(model, Transformer):
        return ModelLayout("tpinv", "", model.args)
    inner = getattr(model, "model", None)
    if hasattr(model, "config") and hasattr(model, "lm_head") and hasattr(inner, "layers"):
        return ModelLayout("hf", "model.", ModelArgs.from_hf_config(model.config.to_dict()))
    raise TypeError(f"expected a HF Qwen3/Llama/Mistral *ForCausalLM (with .model.layers and "
                    f".lm_head) or a tpinv.models.Transformer, got {type(model).__name__}")


def validate(model: nn.Module, tp_size: int, plan: str = "invariant",
             leaves: int = DEFAULT_LEAVES) -> ModelLayout:
    """Raise a clear error unless ``plan`` can shard ``model`` over ``tp_size`` ranks.

    Checks the plan name, the model type, that no parameter is a DTensor yet, and the sizes:
    heads, KV heads, intermediate, vocabulary (and hidden) divisible by ``tp_size``; for the
    invariant plan also ``tp_size`` a power of two dividing ``leaves`` and every reduced
    size divisible by ``leaves`` (:func:`tpinv.models.check_model_sizes`), and a ``tp_size``
    above the KV heads a multiple of them (KV heads replicated; torch's plans refuse it).
    """
    if plan not in PLANS:
        raise ValueError(f"plan={plan!r}: expected one of {PLANS}")
    layout = _layout(model)
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise InvarianceError(f"{type(model).__name__} is already parallelized ({sharded[0]} is a "
                              f"DTensor); apply a plan once, to an unsharded model")
    args = layout.args
    if layout.kind == "tpinv":
        if plan != "invariant":
            raise TypeError(f"plan={plan!r} uses torch's styles, which shard nn.Linear / nn.Embedding "
                            f"only; a tpinv.models.Transformer takes plan='invariant'")
        if model.tp_size != 1:
            raise InvarianceError(f"the Transformer was built with a TP group of {model.tp_size} ranks; "
                                  f"build it with a one-rank group (tpinv.distributed.groups.LOCAL, or "
                                  f"None in one process) and let the plan shard it")
        if model.leaves != leaves:
            raise InvarianceError(f"the Transformer was built with leaves={model.leaves}, the plan "
                                  f"asks for leaves={leaves}; use the same leaf count")
    if plan == "invariant":  # TP above the KV heads: replicated KV heads (a multiple of them)
        check_leaves(leaves)
        check_model_sizes(args, tp_size, leaves)
        return layout
    if tp_size > args.num_kv_heads:
        raise InvarianceError(f"TP={tp_size} exceeds num_kv_heads={args.num_kv_heads}: plan={plan!r} "
                              f"(torch's styles) needs whole KV heads per rank; use TP <= "
                              f"{args.num_kv_heads}, or plan='invariant', which replicates KV heads "
                              f"(docs/scale-out.md)")
    for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size", "hidden_size"):
        check_divisible(name, getattr(args, name), tp_size, "tensor-parallel size")
    return layout


def _lm_head_output(shard_logits: bool):
    if shard_logits:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(output_layouts=Replicate())


def _torch_plan(model, tp_mesh, plan: str, shard_logits: bool) -> dict[str, ParallelStyle]:
    layout = validate(model, tp_mesh.size(), plan)
    p, a = layout.prefix, layout.args
    styles: dict[str, ParallelStyle] = {f"{p}embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    styles[f"{p}layers.*.self_attn"] = ShardedHeads(a.num_heads, a.num_kv_heads)
    for name in _COLUMNS:
        styles[f"{p}layers.*.{name}"] = ColwiseParallel()
    for name in _ROWS:
        styles[f"{p}layers.*.{name}"] = RowwiseParallel() if plan == "default" else ColwiseParallel(
            input_layouts=Shard(-1), output_layouts=Replicate(), use_local_output=True)
    styles["lm_head"] = _lm_head_output(shard_logits)
    return styles


def default_plan(model: nn.Module, tp_mesh: DeviceMesh, *,
                 shard_logits: bool = False) -> dict[str, ParallelStyle]:
    """The usual Megatron-like plan (row-parallel o_proj/down_proj): not TP-invariant."""
    return _torch_plan(model, tp_mesh, "default", shard_logits)


def numerically_stable_plan(model: nn.Module, tp_mesh: DeviceMesh, *,
                            shard_logits: bool = False) -> dict[str, ParallelStyle]:
    """The column-only plan: no cross-rank sum in the forward; the backward still has plain ones."""
    return _torch_plan(model, tp_mesh, "numerically_stable", shard_logits)


def invariant_plan(model: nn.Module, tp_mesh: DeviceMesh, *, leaves: int = DEFAULT_LEAVES,
                   shard_logits: bool = False) -> dict[str, ParallelStyle]:
    """The column-only layout on tpinv's ops: the same bits at every TP size dividing ``leaves``."""
    layout = validate(model, tp_mesh.size(), "invariant", leaves)
    p, a = layout.prefix, layout.args
    styles: dict[str, ParallelStyle] = {f"{p}embed_tokens": InvariantVocabEmbedding(leaves=leaves)}
    for name in _COLUMNS:
        styles[f"{p}layers.*.{name}"] = InvariantColwiseParallel(leaves=leaves)
    replicas = kv_replicas(a, tp_mesh.size())  # 1 unless TP exceeds the KV heads
    if replicas > 1:  # each KV head's k/v rows held by `replicas` ranks, (Shard(0), Replicate())
        kv_mesh = replica_mesh(tp_mesh, a.num_kv_heads)
        for name in ("self_attn.k_proj", "self_attn.v_proj"):
            styles[f"{p}layers.*.{name}"] = InvariantColwiseParallel(leaves=leaves, replica_mesh=kv_mesh)
    for name in _ROWS:
        styles[f"{p}layers.*.{name}"] = InvariantColumnOnlyParallel(leaves=leaves)
    if layout.kind == "tpinv":
        if shard_logits:
            raise ValueError("a tpinv.models.Transformer returns vocabulary-sharded logits by design "
                             "(use model.loss or gather_logits=True); shard_logits applies to HF models")
        styles[f"{p}layers.*.self_attn"] = ShardedHeads(a.num_heads, a.num_kv_heads, replicas)
        styles["lm_head"] = InvariantColwiseParallel(output="shard", leaves=leaves)
        styles[""] = TpinvModelGroup()
        return styles
    styles[f"{p}layers.*.self_attn"] = TpinvAttention(a.num_heads, a.num_kv_heads, a.head_dim, replicas)
    if a.qk_norm:
        styles[f"{p}layers.*.self_attn.q_norm"] = TpinvHeadRMSNorm()
        styles[f"{p}layers.*.self_attn.k_norm"] = TpinvHeadRMSNorm(replicas)
    styles[f"{p}layers.*.mlp"] = TpinvMLP()
    for name in ("layers.*.input_layernorm", "layers.*.post_attention_layernorm", "norm"):
        styles[f"{p}{name}"] = TpinvRMSNorm()
    styles[f"{p}rotary_emb"] = TpinvRotary(a.head_dim, a.rope_theta, a.rope_scaling)
    styles["lm_head"] = InvariantColwiseParallel(
        output="dtensor" if shard_logits else "replicate", leaves=leaves)
    return styles


def _unresolved(module: nn.Module, parts: list[str], path: str) -> Optional[str]:
    """The first module on ``parts``' path (walked as ``parallelize_module`` walks it) that
    lacks a matching child, or None."""
    if not parts:
        return None
    children = [(n, c) for n, c in module.named_children() if fnmatch(n, parts[0])]
    if not children:
        return f"{path or 'the model'} has no submodule matching {parts[0]!r}"
    for name, child in children:
        missing = _unresolved(child, parts[1:], f"{path}.{name}" if path else name)
        if missing:
            return missing
    return None


def _check_matches(model: nn.Module, styles: dict[str, ParallelStyle]) -> None:
    """Every plan key must resolve everywhere it applies (``parallelize_module`` only warns)."""
    for key in styles:
        missing = _unresolved(model, key.split("."), "") if key else None
        if missing:
            raise ValueError(f"plan key {key!r} matches no module: {missing} "
                             f"({type(model).__name__}; expected HF-style names such as "
                             f"'model.layers.0.self_attn.q_proj')")


def parallelize(model: nn.Module, tp_mesh: DeviceMesh, plan: str = "invariant", *,
                leaves: int = DEFAULT_LEAVES, shard_logits: bool = False) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` with the named plan; returns it.

    Every rank must hold the same full weights (rank 0's are scattered).  Tied embedding
    and lm_head weights stay tied (both are ``Shard(0)`` over the vocabulary).
    """
    if plan not in PLANS:
        raise ValueError(f"plan={plan!r}: expected one of {PLANS}")
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise ValueError(f"expected a 1-D DeviceMesh (slice a N-D mesh, e.g. mesh['tp']), got {tp_mesh!r}")
    if plan == "invariant":
        styles = invariant_plan(model, tp_mesh, leaves=leaves, shard_logits=shard_logits)
    elif leaves != DEFAULT_LEAVES:
        raise ValueError(f"leaves={leaves} is the invariant plan's leaf count; plan={plan!r} takes none "
                         f"(its reductions are torch's)")
    else:
        styles = _torch_plan(model, tp_mesh, plan, shard_logits)
    _check_matches(model, styles)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.embed_tokens
    tied = getattr(model.lm_head, "weight", None) is not None and model.lm_head.weight is embed.weight
    root = styles.pop("", None)  # the model itself: torch < 2.7's parallelize_module skips a "" key
    parallelize_module(model, tp_mesh, styles)
    if root is not None:
        parallelize_module(model, tp_mesh, root)
    if tied:
        model.lm_head.weight = embed.weight
    if shard_logits:
        model.register_forward_pre_hook(_refuse_hf_labels, with_kwargs=True)
    return model


def _refuse_hf_labels(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A model parallelized with ``shard_logits=True`` returns vocabulary-sharded logits, which
    HF's own ``labels=`` loss cannot read (torch fails deep inside it on mixed DTensor and
    tensor operands): refused here, naming the loss that reads them."""
    if kwargs.get("labels") is not None:
        raise ValueError("this model was parallelized with shard_logits=True: its logits are a "
                         "vocabulary-sharded DTensor, which HF's labels= loss cannot read; call it "
                         "without labels and take tpinv.dtensor.cross_entropy(outputs.logits, targets), "
                         "or parallelize with shard_logits=False (whole logits, HF's loss works)")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                  leaves: int = DEFAULT_LEAVES) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shape of ``targets``) in the contract's order.

    ``logits`` is a ``Shard(-1)`` DTensor (the vocabulary split over a 1-D mesh: the max is
    exact, the sum of exponentials a tree reduction across ranks), a ``Replicate`` DTensor
    or a plain ``[..., V]`` tensor; all give the same bits.
    """
    group = LOCAL  # a plain or Replicate tensor: the whole vocabulary is here
    if isinstance(logits, DTensor):
        placement = logits.placements[0] if len(logits.placements) == 1 else None
        if placement is not None and placement.is_shard() and placement.dim % logits.ndim == logits.ndim - 1:
            group = logits.device_mesh.get_group()
        elif placement is None or not placement.is_replicate():
            raise InvarianceError(f"cross_entropy expects logits on a 1-D mesh, Shard(-1) or Replicate; "
                                  f"got placements {logits.placements}")
        logits = logits.to_local()
    return vocab_parallel_cross_entropy(logits, targets, tp_group=group, leaves=leaves)
