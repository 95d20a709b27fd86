"""Parity of the tpinv decoder with Hugging Face transformers' Qwen3 / Llama / Mistral (eager).

Tiny random HF models are saved with ``save_pretrained`` (safetensors), their config read by
``ModelArgs.from_hf_config`` and their weights loaded by stripping ``model.``; the logits are
compared with ``allclose``-style bounds (different summation orders, so not bitwise):

* fp32: max abs diff < 1e-4 (measured: 2.3e-6 to 3.3e-6 on logits of magnitude up to 3-4);
* bf16: both models run in bf16; max abs diff < 0.125 and mean abs diff < 0.02 (measured: max
  0.041 to 0.057, i.e. about 3 bf16 ulps at magnitude 2-4, mean 0.006 to 0.008; HF rounds the
  RoPE tables to bf16 and rounds at other points than tpinv's fp32-inside ops).
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from tpinv.models import ModelArgs, Transformer  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits
from tpinv.testing.hf import rope_config_kwargs  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, rms_norm_eps=1e-6,
            max_position_embeddings=512, initializer_range=0.1, attn_implementation="eager")


def hf_config(family: str):
    if family == "qwen3":
        return transformers.Qwen3Config(**TINY, intermediate_size=192, num_attention_heads=8,
                                        num_key_value_heads=4, head_dim=16, tie_word_embeddings=True,
                                        **rope_config_kwargs(1e6))
    if family == "llama":
        return transformers.LlamaConfig(**TINY, intermediate_size=176, num_attention_heads=4,
                                        num_key_value_heads=2, **rope_config_kwargs(
                                            5e5, "llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position_embeddings=16))
    return transformers.MistralConfig(**TINY, intermediate_size=160, num_attention_heads=8,
                                      num_key_value_heads=4, head_dim=8, sliding_window=4)


CLASSES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


def save_hf(family: str, path):
    """A random HF model of ``family`` (non-trivial norm weights) saved as safetensors at ``path``."""
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[family])(hf_config(family))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=("qwen3", "llama", "mistral"))
def saved(request, tmp_path_factory):
    family = request.param
    return family, save_hf(family, tmp_path_factory.mktemp(family))


def load_tpinv(path, dtype) -> Transformer:
    """The test's loader: HF names minus ``model.``; a tied ``lm_head`` is the embedding."""
    args = ModelArgs.from_hf_config(path, dtype=dtype)
    weights = {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        weights[name.removeprefix("model.")] = t.to(dtype)
    model = Transformer(args)
    model.load_state_dict(weights, strict=True)
    return model.eval()


def logits_pair(family, path, dtype, tokens):
    hf = getattr(transformers, CLASSES[family]).from_pretrained(path, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        return load_tpinv(path, dtype)(tokens), hf.eval()(tokens).logits


def test_config_read(saved):
    family, path = saved
    args = ModelArgs.from_hf_config(path)
    assert args.family == family
    assert args.qk_norm == (family == "qwen3")
    assert args.tie_word_embeddings == (family == "qwen3")
    assert args.sliding_window == (4 if family == "mistral" else None)
    assert (args.rope_scaling or {}).get("rope_type") == ("llama3" if family == "llama" else None)


def test_fp32_logits_match_hf(saved):
    family, path = saved
    tokens = torch.randint(0, 256, (2, 23), generator=torch.Generator().manual_seed(1))  # > window, > 16
    ours, theirs = logits_pair(family, path, torch.float32, tokens)
    diff = (ours - theirs).abs().max().item()
    assert theirs.abs().max() > 0.5  # logits of order one, so the bound means something
    assert diff < 1e-4, f"{family}: fp32 max abs diff {diff:.3g}"


def test_bf16_logits_match_hf(saved):
    family, path = saved
    tokens = torch.randint(0, 256, (2, 23), generator=torch.Generator().manual_seed(2))
    ours, theirs = logits_pair(family, path, torch.bfloat16, tokens)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    diff = (ours.float() - theirs.float()).abs()
    assert diff.max() < 0.125 and diff.mean() < 0.02, f"{family}: bf16 max {diff.max():.3g}, mean {diff.mean():.3g}"


def test_sliding_window_matters(tmp_path):
    """Mistral: the window changes the result past the window (so the parity above covers it)."""
    path = save_hf("mistral", tmp_path)
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    model = load_tpinv(path, torch.float32)
    full = Transformer(model.args.replace(sliding_window=None))
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert_same_bits(model(tokens)[:, :4], full(tokens)[:, :4], 'model(tokens)[:, :4]')
        assert_bits_differ(model(tokens)[:, 4:], full(tokens)[:, 4:], 'model(tokens)[:, 4:]')
