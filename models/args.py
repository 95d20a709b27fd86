"""Model hyper-parameters of the Qwen3 / Llama / Mistral decoder, and reading them from HF configs.

The three families share one decoder (:mod:`tpinv.models.transformer`); they differ only by
the flags held here: ``qk_norm`` (Qwen3), ``rope_scaling`` (Llama 3), ``sliding_window``
(Mistral), ``tie_word_embeddings`` and ``attention_bias``.  Nothing here touches numerics:
the reduction order is fixed by the layers and ops, whatever the sizes.

A key missing from a HF config takes the value transformers gives it (:data:`HF_DEFAULTS`), so a
config means the same model here and there: a Mistral config without ``sliding_window`` attends
through a window of 4096 tokens, a Qwen3 config without ``head_dim`` has heads of 128.

:func:`check_model_sizes` says whether the sizes split into the contract's leaves and a TP size
(naming the field that does not), :func:`kv_replicas` how many ranks hold each KV head.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Union

import torch

from tpinv.core.contract import InvarianceError, check_divisible, check_dtype, check_tp_size
from tpinv.core.dtypes import MODEL_DTYPES, dtype_from_name

#: HF ``architectures`` entry -> family.
ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
}
FAMILIES = tuple(ARCHITECTURES.values())

#: RoPE scaling types the decoder supports (``None`` means plain RoPE).
ROPE_SCALING_TYPES = ("linear", "llama3")

#: In :data:`HF_DEFAULTS`: the value is derived from other keys, as transformers derives it.
HEADS, HIDDEN_OVER_HEADS = "num_attention_heads", "hidden_size // num_attention_heads"

#: What transformers gives a key that a config leaves out, per family: the keyword defaults of
#: ``Qwen3Config``, ``LlamaConfig`` and ``MistralConfig`` (and, for a Mistral ``head_dim``, the
#: modeling code's fallback), the same in transformers 4.57 and 5.x for every key listed.
#: ``tests/unit/test_hf_config_defaults.py`` checks this table against the installed transformers.
HF_DEFAULTS = {
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
              "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28},
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": HEADS, "head_dim": HIDDEN_OVER_HEADS,
              "max_position_embeddings": 2048},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": HIDDEN_OVER_HEADS,
                "max_position_embeddings": 131072, "sliding_window": 4096},
}
#: Defaults shared by the three families (both transformers versions).
HF_COMMON_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                      "attention_bias": False, "hidden_act": "silu"}


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Shape and flags of one decoder-only model (HF naming in the comments)."""

    family: str                       # "qwen3" | "llama" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int                   # num_hidden_layers
    num_heads: int                    # num_attention_heads
    num_kv_heads: int                 # num_key_value_heads
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = dataclasses.field(default=None, hash=False)
    max_position_embeddings: int = 4096
    sliding_window: Optional[int] = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: expected one of {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                             f"{self.num_kv_heads}; expected num_heads = g * num_kv_heads (GQA)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: RoPE rotates pairs, expected an even head_dim")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r}: expected None or a positive int")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ROPE_SCALING_TYPES:
                raise NotImplementedError(f"rope_scaling type {kind!r} is not supported; supported: "
                                          f"{ROPE_SCALING_TYPES} or None (plain RoPE)")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype={self.dtype!r}: expected a torch.dtype such as torch.bfloat16")
        check_dtype(self.dtype, "ModelArgs.dtype")

    def replace(self, **changes: Any) -> "ModelArgs":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, path_or_dict: Union[str, os.PathLike, dict], *,
                       dtype: Optional[torch.dtype] = None) -> "ModelArgs":
        """Read a HF ``config.json`` (a file, the directory holding it, or its dict).

        ``dtype`` overrides the config's own ``dtype`` / ``torch_dtype`` (default fp32).
        """
        raw = _load_config(path_or_dict)
        family = _family(raw)
        cfg = with_hf_defaults(raw, family)
        if cfg["hidden_act"] != "silu":
            raise NotImplementedError(f"hidden_act={cfg['hidden_act']!r} is not supported; only 'silu'")
        if cfg.get("mlp_bias", False):
            raise NotImplementedError("mlp_bias=True is not supported (the MLP projections have no bias)")
        theta, scaling = _rope(cfg)
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg["max_position_embeddings"],
            sliding_window=_sliding_window(cfg, family),
            tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
            qk_norm=family == "qwen3",
            # transformers' Mistral has no attention bias (MistralConfig has no such key)
            attention_bias=family != "mistral" and bool(cfg["attention_bias"]),
            dtype=dtype if dtype is not None else _config_dtype(cfg),
        )


def _load_config(path_or_dict) -> dict:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def with_hf_defaults(cfg: dict, family: str) -> dict:
    """``cfg`` with every key tpinv reads present: missing keys take transformers' values.

    A key given as ``null`` means what it means to transformers: ``num_key_value_heads: null``
    is ``num_attention_heads`` (transformers 4.57; 5.x refuses it for Mistral), ``head_dim: null``
    is ``hidden_size // num_attention_heads`` for Llama and Mistral and refused for Qwen3
    (transformers 5.x refuses it; 4.57 builds no working model from it), ``sliding_window: null``
    is full attention.
    """
    out = dict(cfg)
    for key, value in {**HF_COMMON_DEFAULTS, **HF_DEFAULTS[family]}.items():
        out.setdefault(key, value)
    if out["num_key_value_heads"] in (HEADS, None):
        out["num_key_value_heads"] = out["num_attention_heads"]
    if out["head_dim"] is None and family == "qwen3":
        raise ValueError("head_dim=null in a Qwen3 config: give the head size (transformers 5.x refuses it too; "
                         "when the key is left out it is 128)")
    if out["head_dim"] in (HIDDEN_OVER_HEADS, None):
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    for key in ("rms_norm_eps", "tie_word_embeddings", "attention_bias", "hidden_act"):
        if out[key] is None:
            out[key] = HF_COMMON_DEFAULTS[key]
    return out


def _family(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not archs and cfg.get("model_type") in FAMILIES:
        return cfg["model_type"]
    raise NotImplementedError(
        f"architecture {archs or cfg.get('model_type')!r} is not supported; supported architectures: "
        f"{', '.join(ARCHITECTURES)}")


def _rope(cfg: dict) -> tuple[float, Optional[dict]]:
    """``(theta, scaling)`` from either ``rope_parameters`` or ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    scaling = {**legacy, **params}
    scaling.pop("rope_theta", None)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return float(theta), None
    if kind not in ROPE_SCALING_TYPES:
        raise NotImplementedError(f"rope_type {kind!r} is not supported; supported: 'default', "
                                  f"{', '.join(repr(t) for t in ROPE_SCALING_TYPES)}")
    return float(theta), scaling


def _sliding_window(cfg: dict, family: str) -> Optional[int]:
    """Mistral: ``sliding_window`` (4096 when left out, full attention when null).  Qwen3: every layer
    must attend fully -- per-layer windows (``layer_types`` with ``"sliding_attention"``, or
    ``use_sliding_window`` with layers from ``max_window_layers`` on) are refused.  Llama: none."""
    if family == "mistral":
        return cfg.get("sliding_window") or None
    if family == "qwen3":
        window = cfg["sliding_window"] if cfg["use_sliding_window"] else None
        kinds = cfg.get("layer_types") or [
            "sliding_attention" if window is not None and i >= cfg["max_window_layers"] else "full_attention"
            for i in range(cfg["num_hidden_layers"])]
        sliding = [i for i, kind in enumerate(kinds) if kind != "full_attention"]
        if sliding:
            raise NotImplementedError(
                f"Qwen3 with sliding-window layers {sliding} (use_sliding_window={cfg['use_sliding_window']}, "
                f"max_window_layers={cfg['max_window_layers']}, layer_types) is not supported: tpinv's Qwen3 "
                f"attends over the full context in every layer")
    return None


def _config_dtype(cfg: dict) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return dtype_from_name(name, allowed=MODEL_DTYPES, error=NotImplementedError, what="config dtype")


def kv_replicas(args: ModelArgs, tp_size: int) -> int:
    """Ranks holding each KV head: 1 while TP <= num_kv_heads, else ``TP / num_kv_heads``."""
    if tp_size <= args.num_kv_heads:
        return 1
    if tp_size % args.num_kv_heads:
        raise InvarianceError(f"TP={tp_size} exceeds num_kv_heads={args.num_kv_heads} and is not a multiple "
                              f"of it: KV heads are replicated TP/num_kv_heads times; use a TP that "
                              f"num_kv_heads divides or that divides num_kv_heads")
    return tp_size // args.num_kv_heads


def check_model_sizes(args: ModelArgs, tp_size: int, leaves: int) -> None:
    """Raise InvarianceError naming the field that does not split into ``leaves`` / ``tp_size``."""
    check_tp_size(tp_size, leaves)
    kv_replicas(args, tp_size)
    for name in ("num_heads", "intermediate_size", "vocab_size"):
        check_divisible(name, getattr(args, name), tp_size, "tensor-parallel size")
    if tp_size <= args.num_kv_heads:
        check_divisible("num_kv_heads", args.num_kv_heads, tp_size, "tensor-parallel size")
    for name in ("hidden_size", "intermediate_size", "vocab_size"):
        check_divisible(name, getattr(args, name), leaves, "leaves")
    for name, size in (("num_heads*head_dim", args.num_heads * args.head_dim),
                       ("num_kv_heads*head_dim", args.num_kv_heads * args.head_dim)):
        check_divisible(name, size, leaves, "leaves")
