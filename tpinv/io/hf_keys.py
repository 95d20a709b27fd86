"""HF <-> tpinv key maps of the Qwen3 / Llama / Mistral decoder, each key with its expected shape.

A tpinv name is the HF name without the leading ``model.`` (``lm_head.weight`` keeps its
name).  Every key carries the shape :class:`ModelArgs` implies and how tensor parallelism
splits it (column: dim 0; row: dim 1 under ``row_strategy="tree"``, dim 0 under
``"column_only"``; replicated: never), the same split the model's layers mark on their
parameters.  Fused HF tensors (``qkv_proj`` = ``[q; k; v]``, ``gate_up_proj`` = ``[gate; up]``)
map to row ranges of one HF tensor.  Nothing here reads or converts values.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tpinv.core.dtypes import MODEL_DTYPES, dtype_from_name
from tpinv.models.args import ARCHITECTURES, ModelArgs

COLUMN, ROW, REPLICATED = "column", "row", None

Shape = Callable[[ModelArgs], tuple]


def _q(a: ModelArgs) -> int:
    return a.num_heads * a.head_dim


def _kv(a: ModelArgs) -> int:
    return a.num_kv_heads * a.head_dim


@dataclass(frozen=True)
class KeyTemplate:
    """``hf`` / ``tpinv`` name templates (``{}`` = layer index), shape, parallel kind, presence."""
    hf: str
    tpinv: str
    shape: Shape
    kind: Optional[str]
    when: Callable[[ModelArgs], bool] = lambda a: True


_ALWAYS = lambda a: True  # noqa: E731
_BIAS = lambda a: a.attention_bias  # noqa: E731
_QK_NORM = lambda a: a.qk_norm  # noqa: E731

TOP_KEYS = (
    KeyTemplate("model.embed_tokens.weight", "embed_tokens.weight", lambda a: (a.vocab_size, a.hidden_size), COLUMN),
    KeyTemplate("model.norm.weight", "norm.weight", lambda a: (a.hidden_size,), REPLICATED),
    KeyTemplate("lm_head.weight", "lm_head.weight", lambda a: (a.vocab_size, a.hidden_size), COLUMN,
                lambda a: not a.tie_word_embeddings),
)

LAYER_KEYS = (
    KeyTemplate("model.layers.{}.input_layernorm.weight", "layers.{}.input_layernorm.weight",
                lambda a: (a.hidden_size,), REPLICATED),
    KeyTemplate("model.layers.{}.self_attn.q_proj.weight", "layers.{}.self_attn.q_proj.weight",
                lambda a: (_q(a), a.hidden_size), COLUMN),
    KeyTemplate("model.layers.{}.self_attn.q_proj.bias", "layers.{}.self_attn.q_proj.bias",
                lambda a: (_q(a),), COLUMN, _BIAS),
    KeyTemplate("model.layers.{}.self_attn.k_proj.weight", "layers.{}.self_attn.k_proj.weight",
                lambda a: (_kv(a), a.hidden_size), COLUMN),
    KeyTemplate("model.layers.{}.self_attn.k_proj.bias", "layers.{}.self_attn.k_proj.bias",
                lambda a: (_kv(a),), COLUMN, _BIAS),
    KeyTemplate("model.layers.{}.self_attn.v_proj.weight", "layers.{}.self_attn.v_proj.weight",
                lambda a: (_kv(a), a.hidden_size), COLUMN),
    KeyTemplate("model.layers.{}.self_attn.v_proj.bias", "layers.{}.self_attn.v_proj.bias",
                lambda a: (_kv(a),), COLUMN, _BIAS),
    KeyTemplate("model.layers.{}.self_attn.o_proj.weight", "layers.{}.self_attn.o_proj.weight",
                lambda a: (a.hidden_size, _q(a)), ROW),
    KeyTemplate("model.layers.{}.self_attn.o_proj.bias", "layers.{}.self_attn.o_proj.bias",
                lambda a: (a.hidden_size,), REPLICATED, _BIAS),
    KeyTemplate("model.layers.{}.self_attn.q_norm.weight", "layers.{}.self_attn.q_norm.weight",
                lambda a: (a.head_dim,), REPLICATED, _QK_NORM),
    KeyTemplate("model.layers.{}.self_attn.k_norm.weight", "layers.{}.self_attn.k_norm.weight",
                lambda a: (a.head_dim,), REPLICATED, _QK_NORM),
    KeyTemplate("model.layers.{}.post_attention_layernorm.weight", "layers.{}.post_attention_layernorm.weight",
                lambda a: (a.hidden_size,), REPLICATED),
    KeyTemplate("model.layers.{}.mlp.gate_proj.weight", "layers.{}.mlp.gate_proj.weight",
                lambda a: (a.intermediate_size, a.hidden_size), COLUMN),
    KeyTemplate("model.layers.{}.mlp.up_proj.weight", "layers.{}.mlp.up_proj.weight",
                lambda a: (a.intermediate_size, a.hidden_size), COLUMN),
    KeyTemplate("model.layers.{}.mlp.down_proj.weight", "layers.{}.mlp.down_proj.weight",
                lambda a: (a.hidden_size, a.intermediate_size), ROW),
)

#: Fused HF tensors: template -> the unfused templates whose rows it stacks, in order.
FUSED_KEYS = {
    "model.layers.{}.self_attn.qkv_proj.weight": ("model.layers.{}.self_attn.q_proj.weight",
                                                  "model.layers.{}.self_attn.k_proj.weight",
                                                  "model.layers.{}.self_attn.v_proj.weight"),
    "model.layers.{}.self_attn.qkv_proj.bias": ("model.layers.{}.self_attn.q_proj.bias",
                                                "model.layers.{}.self_attn.k_proj.bias",
                                                "model.layers.{}.self_attn.v_proj.bias"),
    "model.layers.{}.mlp.gate_up_proj.weight": ("model.layers.{}.mlp.gate_proj.weight",
                                                "model.layers.{}.mlp.up_proj.weight"),
}

#: HF keys that hold no parameter (recomputed buffers of older checkpoints): skipped on import.
IGNORED_KEYS = ("model.layers.{}.self_attn.rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ParamSpec:
    """One tpinv tensor: its tpinv and HF names, expected shape and parallel kind."""
    name: str
    hf_name: str
    shape: tuple[int, ...]
    kind: Optional[str]

    def partition_dim(self, row_strategy: str) -> Optional[int]:
        return partition_dim(self.kind, row_strategy)


def partition_dim(kind: Optional[str], row_strategy: str) -> Optional[int]:
    if row_strategy not in ("tree", "column_only"):
        raise ValueError(f"row_strategy={row_strategy!r}: expected 'tree' or 'column_only'")
    if kind is None:
        return None
    return 1 if kind == ROW and row_strategy == "tree" else 0


def param_specs(args: ModelArgs) -> dict[str, ParamSpec]:
    """Every tensor of the model, in model order: ``{tpinv name: ParamSpec}``."""
    out = {}
    top = {t.tpinv: t for t in TOP_KEYS}
    for t in (top["embed_tokens.weight"],):
        out[t.tpinv] = ParamSpec(t.tpinv, t.hf, tuple(t.shape(args)), t.kind)
    for i in range(args.num_layers):
        for t in LAYER_KEYS:
            if t.when(args):
                name = t.tpinv.format(i)
                out[name] = ParamSpec(name, t.hf.format(i), tuple(t.shape(args)), t.kind)
    for t in (top["norm.weight"], top["lm_head.weight"]):
        if t.when(args):
            out[t.tpinv] = ParamSpec(t.tpinv, t.hf, tuple(t.shape(args)), t.kind)
    return out


def param_meta(args: ModelArgs, row_strategy: str = "tree") -> dict[str, Optional[int]]:
    """``{tpinv name: partition dim or None}``, as the model's layers mark their parameters."""
    return {n: s.partition_dim(row_strategy) for n, s in param_specs(args).items()}


def to_hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def to_tpinv_name(hf_name: str) -> str:
    if hf_name == "lm_head.weight":
        return hf_name
    if not hf_name.startswith("model."):
        raise KeyError(f"{hf_name}: expected a HF decoder key starting with 'model.' or 'lm_head.weight'")
    return hf_name[len("model."):]


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{\}", r"(\d+)") + "$")


_FUSED = [(_pattern(k), k, v) for k, v in FUSED_KEYS.items()]
_IGNORED = [_pattern(k) for k in IGNORED_KEYS]


def fused_parts(hf_key: str) -> Optional[tuple[str, ...]]:
    """The unfused HF keys a fused key stacks (rows, in order), or ``None`` for a plain key."""
    for pattern, _, parts in _FUSED:
        m = pattern.match(hf_key)
        if m:
            return tuple(p.format(*m.groups()) for p in parts)
    return None


def is_ignored(hf_key: str) -> bool:
    return any(p.match(hf_key) for p in _IGNORED)


def fused_group(hf_key: str) -> Optional[tuple[str, tuple[str, ...]]]:
    """``(fused key, its parts)`` when ``hf_key`` is the first part of a fused group, else ``None``."""
    for _, template, parts in _FUSED:
        m = _pattern(parts[0]).match(hf_key)
        if m:
            return template.format(*m.groups()), tuple(p.format(*m.groups()) for p in parts)
    return None


# ---- ModelArgs <-> JSON and HF config.json ------------------------------------------------------

def args_to_dict(args: ModelArgs) -> dict:
    d = dataclasses.asdict(args)
    d["dtype"] = str(args.dtype).removeprefix("torch.")
    return d


def args_from_dict(d: dict) -> ModelArgs:
    d = dict(d)
    d["dtype"] = dtype_from_name(d.get("dtype"), allowed=MODEL_DTYPES, what="model_args dtype")
    return ModelArgs(**d)


def hf_config_from_args(args: ModelArgs, dtype: Optional[torch.dtype] = None) -> dict:
    """A HF ``config.json`` dict for ``args`` (the architecture of its family)."""
    arch = {family: name for name, family in ARCHITECTURES.items()}[args.family]
    cfg = {
        "architectures": [arch], "model_type": args.family, "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads, "head_dim": args.head_dim, "hidden_act": "silu",
        "rms_norm_eps": args.rms_norm_eps, "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings, "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": args.attention_bias, "dtype": str(dtype or args.dtype).removeprefix("torch."),
    }
    if args.rope_scaling is not None:
        cfg["rope_scaling"] = dict(args.rope_scaling)
    if args.family == "mistral":
        cfg["sliding_window"] = args.sliding_window
    if args.family == "qwen3":
        cfg["use_sliding_window"] = False
    return cfg
