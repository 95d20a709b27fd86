"""tpinv (HF-named) state dicts <-> megatron-core ``GPTModel`` local-spec state dicts.

megatron-core fuses q/k/v into ``linear_qkv`` laid out per query group,
``[q heads of group g; k_g; v_g]`` for g in 0..num_kv_heads-1, and gate/up into
``linear_fc1 = [gate; up]``.  At TP size C rank r holds query groups
``[r*G/C, (r+1)*G/C)`` of ``linear_qkv`` and ``[gate_r; up_r]`` of ``linear_fc1``; the row
layers (``linear_proj``, ``linear_fc2``) are split along their input dim.  Values are only
moved, never changed, so a round trip returns the same bits.
"""
from __future__ import annotations

from typing import Mapping

import torch

from tpinv.io.checkpoint import CheckpointError, shard_index
from tpinv.models.args import ModelArgs

#: ``{}`` = layer index; tpinv name -> megatron-core local-spec name, for the unfused tensors.
PLAIN_KEYS = {
    "layers.{}.input_layernorm.weight": "decoder.layers.{}.input_layernorm.weight",
    "layers.{}.self_attn.o_proj.weight": "decoder.layers.{}.self_attention.linear_proj.weight",
    "layers.{}.self_attn.o_proj.bias": "decoder.layers.{}.self_attention.linear_proj.bias",
    "layers.{}.self_attn.q_norm.weight": "decoder.layers.{}.self_attention.q_layernorm.weight",
    "layers.{}.self_attn.k_norm.weight": "decoder.layers.{}.self_attention.k_layernorm.weight",
    "layers.{}.post_attention_layernorm.weight": "decoder.layers.{}.pre_mlp_layernorm.weight",
    "layers.{}.mlp.down_proj.weight": "decoder.layers.{}.mlp.linear_fc2.weight",
}
TOP_KEYS = {"embed_tokens.weight": "embedding.word_embeddings.weight", "norm.weight": "decoder.final_layernorm.weight",
            "lm_head.weight": "output_layer.weight"}
QKV_KEY = "decoder.layers.{}.self_attention.linear_qkv.{}"
FC1_KEY = "decoder.layers.{}.mlp.linear_fc1.weight"
FC1_BIAS_KEY, FC2_BIAS_KEY = "decoder.layers.{}.mlp.linear_fc1.bias", "decoder.layers.{}.mlp.linear_fc2.bias"
#: Partition dim of the weights of the plain (unfused) split layers; everything else is replicated.
_SPLIT = {"linear_proj": 1, "linear_fc2": 1, "word_embeddings": 0, "output_layer": 0}


def _interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, 1).reshape(-1, *rest)


def _deinterleave(qkv: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, hd = args.num_kv_heads, args.head_dim
    per = args.num_heads // g * hd
    grouped = qkv.reshape(g, per + 2 * hd, *qkv.shape[1:])
    q, k, v = grouped.split([per, hd, hd], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))


def _split_dim(meg_name: str) -> int | None:
    *parents, leaf = meg_name.split(".")
    dims = [_SPLIT[p] for p in parents if p in _SPLIT]
    return dims[0] if dims and leaf == "weight" else None


def to_megatron_state_dict(state_dict: Mapping[str, torch.Tensor], args: ModelArgs, *, tp: int = 1,
                           rank: int = 0) -> dict[str, torch.Tensor]:
    """Map a full tpinv state dict to megatron-core local-spec names (rank ``rank``'s shard at TP ``tp``).

    The result loads into ``GPTModel(..., transformer_layer_spec=get_gpt_layer_local_spec(
    normalization="RMSNorm", qk_layernorm=args.qk_norm))`` built with
    ``share_embeddings_and_output_weights=args.tie_word_embeddings`` and
    ``add_bias_linear = add_qkv_bias = args.attention_bias`` (the MLP biases are then zeros).
    """
    sd, out = dict(state_dict), {}

    def take(name):
        if name not in sd:
            raise CheckpointError(f"{name} is missing from the state dict (expected by {args.family} ModelArgs)")
        return sd.pop(name)

    for i in range(args.num_layers):
        for kind in ("weight", "bias") if args.attention_bias else ("weight",):
            q, k, v = (take(f"layers.{i}.self_attn.{p}_proj.{kind}") for p in "qkv")
            if args.num_kv_heads % tp:
                raise CheckpointError(f"num_kv_heads={args.num_kv_heads} does not split into tp={tp} ranks")
            qkv = _interleave(q, k, v, args.num_kv_heads)
            out[QKV_KEY.format(i, kind)] = qkv[shard_index(qkv.shape, 0, tp, rank, "linear_qkv")]
        gate, up = take(f"layers.{i}.mlp.gate_proj.weight"), take(f"layers.{i}.mlp.up_proj.weight")
        out[FC1_KEY.format(i)] = torch.cat([gate[shard_index(gate.shape, 0, tp, rank, "gate_proj")],
                                            up[shard_index(up.shape, 0, tp, rank, "up_proj")]], 0)
        if args.attention_bias:  # megatron's add_bias_linear also gives the MLP biases: zeros add nothing
            out[FC1_BIAS_KEY.format(i)] = gate.new_zeros(2 * args.intermediate_size // tp)
            out[FC2_BIAS_KEY.format(i)] = gate.new_zeros(args.hidden_size)
        for src, dst in PLAIN_KEYS.items():
            if src.format(i) in sd:
                t = sd.pop(src.format(i))
                out[dst.format(i)] = t[shard_index(t.shape, _split_dim(dst), tp, rank, dst.format(i))]
    for src, dst in TOP_KEYS.items():
        if src in sd:
            t = sd.pop(src)
            out[dst] = t[shard_index(t.shape, _split_dim(dst), tp, rank, dst)]
    if sd:
        raise CheckpointError(f"keys with no megatron-core name: {sorted(sd)[:5]}")
    return out


def from_megatron_state_dict(state_dict: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_megatron_state_dict` at TP 1: split ``linear_qkv`` / ``linear_fc1``.

    ``_extra_state`` entries (megatron's FP8 metadata slots) and all-zero MLP biases are dropped.
    """
    sd = {k: v for k, v in state_dict.items() if not k.endswith("._extra_state")}
    out = {}
    for i in range(args.num_layers):
        for kind in ("weight", "bias") if args.attention_bias else ("weight",):
            key = QKV_KEY.format(i, kind)
            if key not in sd:
                raise CheckpointError(f"{key} is missing from the megatron state dict")
            for p, t in zip("qkv", _deinterleave(sd.pop(key), args)):
                out[f"layers.{i}.self_attn.{p}_proj.{kind}"] = t
        if FC1_KEY.format(i) not in sd:
            raise CheckpointError(f"{FC1_KEY.format(i)} is missing from the megatron state dict")
        gate, up = sd.pop(FC1_KEY.format(i)).chunk(2, 0)
        for key in (FC1_BIAS_KEY.format(i), FC2_BIAS_KEY.format(i)):
            if key in sd and bool(sd.pop(key).ne(0).any()):
                raise CheckpointError(f"{key} is not zero: the HF MLP has no bias to hold it")
        out[f"layers.{i}.mlp.gate_proj.weight"], out[f"layers.{i}.mlp.up_proj.weight"] = gate, up
        for dst, src in PLAIN_KEYS.items():
            if src.format(i) in sd:
                out[dst.format(i)] = sd.pop(src.format(i))
    for dst, src in TOP_KEYS.items():
        if src in sd:
            out[dst] = sd.pop(src)
    if sd:
        raise CheckpointError(f"unexpected megatron keys: {sorted(sd)[:5]}")
    return out
