"""Named model shapes: tiny ones for CPU tests and real-model shapes for GPU runs.

Every tiny config has vocab 256 and hidden/intermediate/head sizes that split into the
default 8 leaves and into TP 1, 2 and 4 (``num_kv_heads >= 4``), so the same model can be
run at every TP size the tests compare.  Two are for TP=8: ``qwen3-kv8-tiny`` (8 KV heads,
split 8 ways) and ``qwen3-kv2-tiny`` (2 KV heads, each replicated on 2 ranks at TP=4 and on 4
at TP=8).
"""
from __future__ import annotations

from tpinv.models.args import ModelArgs

_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

CONFIGS: dict[str, ModelArgs] = {
    # Qwen3: q/k RMSNorm, head_dim decoupled from hidden/heads, tied embeddings.
    "qwen3-tiny": ModelArgs(
        family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=192, num_layers=2,
        num_heads=8, num_kv_heads=4, head_dim=16, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        max_position_embeddings=512, tie_word_embeddings=True, qk_norm=True),
    # Llama 3: llama3 RoPE scaling, separate lm_head.
    "llama-tiny": ModelArgs(
        family="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_layers=2,
        num_heads=4, num_kv_heads=4, head_dim=16, rms_norm_eps=1e-5, rope_theta=500_000.0,
        rope_scaling=dict(_LLAMA3_SCALING, original_max_position_embeddings=64),
        max_position_embeddings=512),
    # Mistral: sliding-window attention (a window short enough for test sequences to exceed).
    "mistral-tiny": ModelArgs(
        family="mistral", vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=2,
        num_heads=8, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=512, sliding_window=5),
    # TP=8: 8 KV heads, one per rank.
    "qwen3-kv8-tiny": ModelArgs(
        family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=8, num_kv_heads=8, head_dim=8, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        max_position_embeddings=512, tie_word_embeddings=True, qk_norm=True),
    # TP=8 above the KV-head count: 2 KV heads (GQA group of 4), replicated on TP/2 ranks.
    "qwen3-kv2-tiny": ModelArgs(
        family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=8, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        max_position_embeddings=512, tie_word_embeddings=False, qk_norm=True),
    # Qwen3-0.6B's shape (the smallest Qwen3), for GPU runs.
    "qwen3-0.6b": ModelArgs(
        family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True),
    # Llama-3.2-1B's shape.
    "llama3.2-1b": ModelArgs(
        family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True),
    # Qwen3-8B's shape (memory table: tools/memory_table.py).
    "qwen3-8b": ModelArgs(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True),
    # Llama-3-70B's shape (memory table).
    "llama3-70b": ModelArgs(
        family="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500_000.0,
        max_position_embeddings=8192),
}

#: Other names for the same shapes.
ALIASES = {"qwen3-0.5b": "qwen3-0.6b"}


def config_names() -> list[str]:
    """Every name :func:`get_config` takes: the configs, then their aliases."""
    return sorted(CONFIGS) + sorted(ALIASES)


def get_config(name: str, **overrides) -> ModelArgs:
    """The named config, with ``overrides`` (e.g. ``dtype=torch.bfloat16``) applied."""
    key = ALIASES.get(name, name)
    if key not in CONFIGS:
        raise KeyError(f"unknown model config {name!r}; known: {', '.join(config_names())}")
    args = CONFIGS[key]
    return args.replace(**overrides) if overrides else args
