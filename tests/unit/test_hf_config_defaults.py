"""A HF config means the same model to tpinv as to transformers, keys left out included.

Each case is a partial ``config.json`` dict; the installed transformers' config class
(``Qwen3Config``, ``LlamaConfig``, ``MistralConfig``) resolves it, and the values its modeling
code uses (heads, head size, KV heads, window per layer, RoPE theta, context, biases, ...) must
equal :meth:`ModelArgs.from_hf_config`'s.  The file passes under transformers 4.57 and 5.x; the
one case where they differ (``num_key_value_heads: null`` for Mistral: 4.57 takes the head
count, 5.x refuses the config) follows 4.57.  Controls: the cases that used to differ -- a
Mistral config without ``sliding_window`` (a window of 4096, not full attention), a Qwen3 config
without ``head_dim`` (128, not hidden / heads) -- are asserted by value, and Qwen3 configs with
sliding-window layers are refused, not run with full attention.
"""
from __future__ import annotations

import pytest

from tpinv.models import ModelArgs
from tpinv.models.args import HF_DEFAULTS

transformers = pytest.importorskip("transformers")
MAJOR = int(transformers.__version__.split(".")[0])

ARCH = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)

CASES = {
    "empty": {},
    "small": SMALL,
    "small, kv heads 2": dict(SMALL, num_key_value_heads=2),
    "small, kv heads null": dict(SMALL, num_key_value_heads=None),
    "small, head_dim null": dict(SMALL, head_dim=None),
    "small, head_dim 32": dict(SMALL, head_dim=32),
    "small, window null": dict(SMALL, sliding_window=None),
    "small, window 8": dict(SMALL, sliding_window=8),
    "small, use_sliding_window (no layer reaches max_window_layers)": dict(SMALL, use_sliding_window=True),
    "small, theta, context, eps, tied, bias": dict(SMALL, rope_theta=5e5, max_position_embeddings=64,
                                                   rms_norm_eps=1e-5, tie_word_embeddings=True,
                                                   attention_bias=True),
}


def _config_class(family):
    return {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig,
            "mistral": transformers.MistralConfig}[family]


def _transformers_view(family: str, cfg: dict) -> dict:
    """What transformers' modeling code of ``family`` builds from ``cfg`` (in ModelArgs' names)."""
    c = _config_class(family)(**cfg)
    heads = c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    if family == "qwen3":
        window = None if "sliding_attention" not in (c.layer_types or []) else ("per-layer", c.layer_types)
        head_dim = c.head_dim  # Qwen3Attention: getattr(config, "head_dim", ...) -- the config's value
    else:
        window = getattr(c, "sliding_window", None) if family == "mistral" else None
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_layers=c.num_hidden_layers, num_heads=heads, num_kv_heads=c.num_key_value_heads,
                head_dim=head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=float(theta),
                max_position_embeddings=c.max_position_embeddings, sliding_window=window,
                tie_word_embeddings=c.tie_word_embeddings, attention_bias=bool(getattr(c, "attention_bias", False)))


def _tpinv_view(args: ModelArgs) -> dict:
    return {k: getattr(args, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                          "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta",
                                          "max_position_embeddings", "sliding_window", "tie_word_embeddings",
                                          "attention_bias")}


@pytest.mark.parametrize("family", sorted(ARCH))
@pytest.mark.parametrize("case", sorted(CASES))
def test_missing_keys_take_transformers_values(family, case):
    cfg = CASES[case]
    try:
        want = _transformers_view(family, cfg)
    except Exception as exc:  # noqa: BLE001 - transformers refuses the config (its error types vary by version)
        if family == "mistral" and case == "small, kv heads null" and MAJOR >= 5:
            args = ModelArgs.from_hf_config({"architectures": [ARCH[family]], **cfg})
            assert args.num_kv_heads == args.num_heads  # transformers 4.57's reading, which tpinv follows
            return
        with pytest.raises((ValueError, NotImplementedError)):
            ModelArgs.from_hf_config({"architectures": [ARCH[family]], **cfg})
        pytest.skip(f"transformers {transformers.__version__} refuses it too: {str(exc).splitlines()[0]}")
    if family == "qwen3" and want["head_dim"] is None:  # 4.57 keeps head_dim=None: no working model
        with pytest.raises(ValueError, match="head_dim=null in a Qwen3 config"):
            ModelArgs.from_hf_config({"architectures": [ARCH[family]], **cfg})
        return
    if want["num_heads"] % want["num_kv_heads"]:  # e.g. Qwen3's 32 KV heads for 4 heads: no model either
        with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
            ModelArgs.from_hf_config({"architectures": [ARCH[family]], **cfg})
        return
    got = _tpinv_view(ModelArgs.from_hf_config({"architectures": [ARCH[family]], **cfg}))
    assert got == want


def test_the_defaults_that_used_to_differ():
    eight = {"architectures": ["MistralForCausalLM"], **SMALL, "num_attention_heads": 8}
    mistral = ModelArgs.from_hf_config(eight)
    assert mistral.sliding_window == 4096 and mistral.max_position_embeddings == 131072
    assert mistral.num_kv_heads == 8 and mistral.head_dim == 8
    full = ModelArgs.from_hf_config({**eight, "sliding_window": None})
    assert full.sliding_window is None  # the control: null is full attention
    qwen = ModelArgs.from_hf_config({"architectures": ["Qwen3ForCausalLM"], **SMALL, "num_key_value_heads": 4})
    assert qwen.head_dim == 128 != SMALL["hidden_size"] // SMALL["num_attention_heads"]
    assert qwen.max_position_embeddings == 32768
    llama = ModelArgs.from_hf_config({"architectures": ["LlamaForCausalLM"], **SMALL})
    assert llama.head_dim == 16 and llama.max_position_embeddings == 2048 and llama.num_kv_heads == 4


def test_the_table_is_transformers_defaults():
    for family, table in HF_DEFAULTS.items():
        c = _config_class(family)()
        for key, value in table.items():
            if isinstance(value, str):  # derived: checked by the cases above
                continue
            assert getattr(c, key, value) == value or (key == "sliding_window" and family == "qwen3"), \
                f"{family}.{key}: transformers {getattr(c, key)!r}, tpinv {value!r}"


def test_qwen3_sliding_window_layers_are_refused():
    base = {"architectures": ["Qwen3ForCausalLM"], **SMALL, "num_key_value_heads": 4}
    with pytest.raises(NotImplementedError, match=r"sliding-window layers \[1\]"):
        ModelArgs.from_hf_config({**base, "use_sliding_window": True, "max_window_layers": 1})
    with pytest.raises(NotImplementedError, match=r"sliding-window layers \[0\]"):
        ModelArgs.from_hf_config({**base, "layer_types": ["sliding_attention", "full_attention"]})
    # the control: a window that no layer reaches is full attention, as in transformers
    assert ModelArgs.from_hf_config({**base, "use_sliding_window": True, "max_window_layers": 2}).sliding_window \
        is None
    assert ModelArgs.from_hf_config({**base, "use_sliding_window": True, "sliding_window": None,
                                     "max_window_layers": 0}).sliding_window is None
