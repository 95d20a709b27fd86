"""HF -> tpinv -> megatron-core names: the per-query-group qkv interleave and [gate; up], checked by
loading converted checkpoints into megatron-core GPTModels (local spec and tpinv spec) and comparing
with HF, and the per-rank megatron shards."""
from __future__ import annotations

import pytest
import torch

from test_convert_hf import _hf_model
from tpinv.io.checkpoint import read_info
from tpinv.io.hf_convert import convert_hf_to_tpinv
from tpinv.io.hf_keys import param_specs
from tpinv.testing import assert_same_bits, run_ranks, same_bits

pytest.importorskip("megatron.core")


def _megatron_check(rank, world_size, checkpoints, tokens):
    """In a fresh process: load each converted checkpoint into megatron-core's local-spec GPTModel."""
    import contextlib
    import torch.nn.functional as F
    torch.cuda.current_device = lambda: "cpu"  # megatron-core's CPU path still asks for a device index
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tpinv.io.checkpoint import load_full
    from tpinv.io.hf_keys import args_from_dict as from_dict
    from tpinv.io.megatron_keys import from_megatron_state_dict, to_megatron_state_dict
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    results = []
    for ck in checkpoints:
        args = from_dict(read_info(ck).model_args)
        cfg = TransformerConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
            num_query_groups=args.num_kv_heads, kv_channels=args.head_dim, ffn_hidden_size=args.intermediate_size,
            normalization="RMSNorm", layernorm_epsilon=args.rms_norm_eps, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=args.attention_bias, add_qkv_bias=args.attention_bias,
            qk_layernorm=args.qk_norm, use_cpu_initialization=True, params_dtype=torch.float32,
            hidden_dropout=0.0, attention_dropout=0.0)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(
            qk_layernorm=args.qk_norm, normalization="RMSNorm"), vocab_size=args.vocab_size, max_sequence_length=64,
            share_embeddings_and_output_weights=args.tie_word_embeddings, position_embedding_type="rope",
            rotary_base=args.rope_theta).eval()
        full = load_full(ck)
        model.load_state_dict(to_megatron_state_dict(full, args), strict=True)
        S = tokens.shape[1]
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]
        with torch.no_grad():
            logits = model(tokens, torch.arange(S).expand_as(tokens), mask)
        back = from_megatron_state_dict(model.state_dict(), args)
        same = sorted(back) == sorted(full) and all(same_bits(back[k], full[k]) for k in full)
        # The same checkpoint in a GPTModel built with tpinv's spec (tpinv layers throughout).
        from tpinv.megatron import build_gpt_model
        tp_model = build_gpt_model(cfg, tp_group=parallel_state.get_tensor_model_parallel_group(),
                                   vocab_size=args.vocab_size, max_sequence_length=64,
                                   spec_kwargs=dict(qk_layernorm=args.qk_norm, normalization="RMSNorm"),
                                   share_embeddings_and_output_weights=args.tie_word_embeddings,
                                   position_embedding_type="rope", rotary_base=args.rope_theta).eval()
        missing, unexpected = tp_model.load_state_dict(to_megatron_state_dict(full, args), strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
        with torch.no_grad():
            tp_logits = tp_model(tokens, torch.arange(S).expand_as(tokens), mask)
        results.append((logits, same, tp_logits))
    return results


def test_megatron_state_dict_loads_and_matches_hf(tmp_path):
    """megatron-core names, the per-group qkv interleave and [gate; up], checked by running GPTModel."""
    models, checkpoints = {}, []
    for family in ("qwen3", "llama"):  # qwen3: q/k layernorm, tied; llama: biases, untied
        # plain RoPE (megatron's llama3 scaling has fixed constants), 2 query heads per group, fp32
        hf = models[family] = _hf_model(family, 1, rope_scaling=None, num_attention_heads=8,
                                        num_key_value_heads=4).float()
        hf.save_pretrained(str(tmp_path / family))
        checkpoints.append(convert_hf_to_tpinv(str(tmp_path / family), str(tmp_path / f"{family}-ck")))
    tokens = torch.randint(0, 256, (2, 7))
    results = run_ranks(_megatron_check, 1, checkpoints, tokens, timeout=240)[0]
    for (logits, round_trip, tp_logits), (family, hf) in zip(results, models.items()):
        with torch.no_grad():
            ref = hf(tokens).logits
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)  # fp32 parity with HF
        torch.testing.assert_close(tp_logits, ref, rtol=1e-5, atol=1e-5)  # tpinv spec, same checkpoint
        assert round_trip, family


def test_megatron_tp_shards():
    """Rank r's megatron shard: query groups [r*G/C, (r+1)*G/C) of linear_qkv, [gate_r; up_r], fc2 columns."""
    from tpinv.models.configs import get_config
    from tpinv.io.megatron_keys import to_megatron_state_dict
    args = get_config("llama-tiny", num_heads=8, head_dim=8, attention_bias=True)
    full = {n: torch.randn(s.shape) for n, s in param_specs(args).items()}
    g, hd = args.num_kv_heads, args.head_dim
    per = args.num_heads // g * hd
    whole = to_megatron_state_dict(full, args)
    for tp in (2, 4):
        shards = [to_megatron_state_dict(full, args, tp=tp, rank=r) for r in range(tp)]
        for r, sd in enumerate(shards):
            assert sorted(sd) == sorted(whole)
            qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"].view(g // tp, per + 2 * hd, -1)
            groups = slice(r * g // tp, (r + 1) * g // tp)
            assert_same_bits(qkv[:, :per], full["layers.0.self_attn.q_proj.weight"].view(g, per, -1)[groups],
                             'qkv[:, :per]')
            assert_same_bits(qkv[:, per:per + hd], full["layers.0.self_attn.k_proj.weight"].view(g, hd, -1)[groups],
                             'qkv[:, per:per + hd]')
            assert_same_bits(qkv[:, per + hd:], full["layers.0.self_attn.v_proj.weight"].view(g, hd, -1)[groups],
                             'qkv[:, per + hd:]')
            gate, up = (full[f"layers.0.mlp.{p}_proj.weight"].chunk(tp)[r] for p in ("gate", "up"))
            assert_same_bits(sd["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate, up]),
                             "sd['decoder.layers.0.mlp.linear_fc1.weight']")
            assert_same_bits(sd["decoder.layers.0.mlp.linear_fc2.weight"], full["layers.0.mlp.down_proj.weight"].chunk(tp, 1)[r],
                             "sd['decoder.layers.0.mlp.linear_fc2.weight']")
            assert_same_bits(sd["decoder.layers.0.self_attention.linear_proj.bias"], full["layers.0.self_attn.o_proj.bias"],
                             "sd['decoder.layers.0.self_attention.linear_proj...")  # replicated
        # concatenating the shards of the qkv rows gives back the whole interleaved tensor
        assert_same_bits(torch.cat([sd["decoder.layers.1.self_attention.linear_qkv.bias"] for sd in shards]), whole["decoder.layers.1.self_attention.linear_qkv.bias"],
                         "torch.cat([sd['decoder.layers.1.self_attention....")
