"""Single-process tests of the Qwen3 / Llama / Mistral decoder (TP=1).

Invariance (bitwise, ``assert_same_bits``): full forward == token-by-token decode with a KV cache
== chunked prefill; a request inside a ragged right-padded batch == the request alone, in
prefill and in decode.  Each has a negative control: the same model written in plain torch
(``F.linear`` + a split-KV attention whose key chunks follow the call's shape, so its order
changes between prefill and decode on every CPU kernel set + a torch RMSNorm) differs on the
same inputs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_cases import sdpa as split_kv_attention
from tpinv.core.contract import InvarianceError
from tpinv.models import KVCache, ModelArgs, Transformer, check_model_sizes, get_config
from tpinv.ops import rope_cos_sin
from tpinv.testing import assert_bits_differ, assert_same_bits, record_ops, same_bits

FAMILIES = ("qwen3-tiny", "llama-tiny", "mistral-tiny")
DTYPES = (torch.float32, torch.bfloat16)


def build(name: str, dtype=torch.float32, seed: int = 0, **overrides) -> Transformer:
    """A model with random weights, norm weights included (so every parameter matters)."""
    torch.manual_seed(seed)
    model = Transformer(get_config(name, dtype=dtype, **overrides))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("proj.weight") or pname.endswith("embed_tokens.weight"):
                p.mul_(5.0)  # std 0.1: logits of order one
    return model.eval()


def tokens_for(args: ModelArgs, batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- plain-torch reference
def ref_rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos[:, None] + rot.float() * sin[:, None]).to(x.dtype)


def ref_forward(model: Transformer, tokens, cache: list | None = None):
    """The same model in plain torch; ``cache`` (a list) makes it incremental."""
    a, sd = model.args, model.state_dict()
    B, S = tokens.shape
    start = 0 if not cache else cache[0][0].shape[2]
    pos = torch.arange(start, start + S).expand(B, S)
    cos, sin = rope_cos_sin(pos, a.head_dim, a.rope_theta, a.rope_scaling)
    h = sd["embed_tokens.weight"][tokens]
    for i in range(a.num_layers):
        p = f"layers.{i}."
        x = ref_rms(h, sd[p + "input_layernorm.weight"], a.rms_norm_eps)
        q = F.linear(x, sd[p + "self_attn.q_proj.weight"]).view(B, S, a.num_heads, a.head_dim)
        k = F.linear(x, sd[p + "self_attn.k_proj.weight"]).view(B, S, a.num_kv_heads, a.head_dim)
        v = F.linear(x, sd[p + "self_attn.v_proj.weight"]).view(B, S, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q = ref_rms(q, sd[p + "self_attn.q_norm.weight"], a.rms_norm_eps)
            k = ref_rms(k, sd[p + "self_attn.k_norm.weight"], a.rms_norm_eps)
        q, k, v = ref_rope(q.transpose(1, 2), cos, sin), ref_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)
        if cache is not None:
            if len(cache) > i:
                k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
                cache[i] = (k, v)
            else:
                cache.append((k, v))
        kpos = torch.arange(k.shape[2])
        vis = kpos[None, :] <= pos[0][:, None]
        if a.sliding_window:
            vis &= kpos[None, :] > pos[0][:, None] - a.sliding_window
        o = split_kv_attention(q, k, v, vis.expand(B, *vis.shape))
        h = h + F.linear(o.transpose(1, 2).reshape(B, S, -1), sd[p + "self_attn.o_proj.weight"])
        x = ref_rms(h, sd[p + "post_attention_layernorm.weight"], a.rms_norm_eps)
        act = F.silu(F.linear(x, sd[p + "mlp.gate_proj.weight"])) * F.linear(x, sd[p + "mlp.up_proj.weight"])
        h = h + F.linear(act, sd[p + "mlp.down_proj.weight"])
    h = ref_rms(h, sd["norm.weight"], a.rms_norm_eps)
    return F.linear(h, sd["embed_tokens.weight" if a.tie_word_embeddings else "lm_head.weight"])


def decode_all(model, tokens, chunk: int, max_len: int = 96):
    cache = model.new_cache(tokens.shape[0], max_len)
    return torch.cat([model(tokens[:, s:s + chunk], cache=cache) for s in range(0, tokens.shape[1], chunk)], 1)


def ref_decode_all(model, tokens, chunk: int):
    cache: list = []
    return torch.cat([ref_forward(model, tokens[:, s:s + chunk], cache) for s in range(0, tokens.shape[1], chunk)], 1)


# ---------------------------------------------------------------- invariance
def tol(dtype):
    """Parity of tpinv with the plain-torch model (not bits): per-dtype bounds."""
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FAMILIES)
@torch.no_grad()
def test_decode_and_chunked_prefill_equal_full_forward(name, dtype):
    model = build(name, dtype)
    tokens = tokens_for(model.args, 2, 16, seed=1)  # longer than mistral-tiny's window of 5
    full = model(tokens)
    assert full.shape == (2, 16, 256) and full.dtype == dtype
    assert_same_bits(decode_all(model, tokens, 1), full, 'decode_all(model, tokens, 1)')
    assert_same_bits(decode_all(model, tokens, 3), full, 'decode_all(model, tokens, 3)')
    # Negative control: the plain-torch model differs between full and incremental.
    ref_full = ref_forward(model, tokens)
    torch.testing.assert_close(ref_full.float(), full.float(), **tol(dtype))
    assert_bits_differ(ref_decode_all(model, tokens, 1), ref_full, 'ref_decode_all(model, tokens, 1)')
    assert_bits_differ(ref_decode_all(model, tokens, 3), ref_full, 'ref_decode_all(model, tokens, 3)')


@torch.no_grad()
def test_decode_across_kv_blocks():
    """70 tokens span two 64-slot attention blocks; chunks of 3 straddle the boundary."""
    model = build("qwen3-tiny")
    tokens = tokens_for(model.args, 1, 70, seed=2)
    full = model(tokens)
    assert_same_bits(decode_all(model, tokens, 3), full, 'decode_all(model, tokens, 3)')
    assert_same_bits(decode_all(model, tokens[:, :66], 1), full[:, :66], 'decode_all(model, tokens[:, :66], 1)')
    assert_bits_differ(ref_decode_all(model, tokens, 3), ref_forward(model, tokens), 'ref_decode_all(model, tokens, 3)')


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FAMILIES)
@torch.no_grad()
def test_ragged_batch_equals_each_request_alone(name, dtype):
    model = build(name, dtype, seed=3)
    lengths = [9, 20, 3, 14]
    S, B = max(lengths), len(lengths)
    tokens = tokens_for(model.args, B, S, seed=4)  # positions past a length hold random pad tokens
    batch = model(tokens)
    alone = [model(tokens[b:b + 1, :n]) for b, n in enumerate(lengths)]
    for b, n in enumerate(lengths):
        assert_same_bits(batch[b:b + 1, :n], alone[b], 'batch[b:b + 1, :n]')
    # Ragged prefill into one cache, then two decode steps for the whole batch.
    cache = model.new_cache(B, 24)
    model(tokens, cache=cache, num_valid=torch.tensor(lengths))
    assert cache.lengths.tolist() == lengths
    nxt = tokens_for(model.args, B, 2, seed=5)
    steps = torch.cat([model(nxt[:, t:t + 1], cache=cache) for t in range(2)], 1)
    for b, n in enumerate(lengths):
        seq = torch.cat([tokens[b:b + 1, :n], nxt[b:b + 1]], 1)
        assert_same_bits(steps[b:b + 1], model(seq)[:, n:], 'steps[b:b + 1]')
    # Negative control: in plain torch a request's logits depend on its batch.
    ref_batch = ref_forward(model, tokens)
    assert any(not same_bits(ref_batch[b:b + 1, :n], ref_forward(model, tokens[b:b + 1, :n]))
               for b, n in enumerate(lengths))


MODEL_CACHE: dict = {}


def chunked_row_equals_alone(model, tokens, chunk, row, forward, decode):
    """``row`` of a batch decoded in chunks equals the row's full forward alone."""
    alone = forward(model, tokens[row:row + 1])
    return same_bits(decode(model, tokens, chunk)[row:row + 1], alone)


@settings(max_examples=5, deadline=None)
@given(seq=st.integers(1, 13), batch=st.integers(1, 3), chunk=st.integers(1, 7), row=st.integers(0, 2),
       seed=st.integers(0, 2**16))
@torch.no_grad()
def test_any_chunking_and_batch_position_equal_alone(seq, batch, chunk, row, seed):
    model = MODEL_CACHE.setdefault("mistral", build("mistral-tiny", seed=9))
    tokens = tokens_for(model.args, batch, seq, seed)
    assert chunked_row_equals_alone(model, tokens, chunk, row % batch, Transformer.__call__,
                                    lambda m, t, c: decode_all(m, t, c, max_len=seq + 3))


@torch.no_grad()
def test_any_chunking_control_plain_torch_differs():
    """The negative control of the property above, on one example of its input space."""
    model = MODEL_CACHE.setdefault("mistral", build("mistral-tiny", seed=9))
    tokens = tokens_for(model.args, 3, 13, 5)
    assert chunked_row_equals_alone(model, tokens, 4, 1, Transformer.__call__,
                                    lambda m, t, c: decode_all(m, t, c, max_len=16))
    assert not chunked_row_equals_alone(model, tokens, 4, 1, ref_forward, ref_decode_all)


# ---------------------------------------------------------------- training path
@pytest.mark.parametrize("name", FAMILIES)
def test_loss_log_probs_and_gradients(name):
    model = build(name, torch.float32, seed=6)
    tokens, targets = tokens_for(model.args, 3, 9, 7), tokens_for(model.args, 3, 9, 8)
    loss = model.loss(tokens, targets)
    assert loss.shape == (3, 9) and loss.dtype == torch.float32
    logits = model(tokens)
    expected = F.cross_entropy(logits.reshape(-1, 256).float(), targets.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), expected, atol=1e-5, rtol=1e-5)
    assert_same_bits(model.log_probs(tokens, targets), -loss, 'model.log_probs(tokens, targets)')
    assert_same_bits(model(tokens, gather_logits=True), logits, 'model(tokens, gather_logits=True)')
    loss.backward(torch.ones_like(loss))
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and bool(p.grad.ne(0).any()), pname


def test_invariant_ops_run():
    model = build("qwen3-tiny")
    tokens = tokens_for(model.args, 1, 4, 0)
    with record_ops() as log, torch.no_grad():
        model(tokens)
    for op in ("tpinv::rms_norm", "tpinv::apply_rope", "tpinv::silu_mul", "tpinv::attention"):
        assert op in log, op
    for op in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_attention_math"):
        assert op not in log, op


def test_module_names_follow_hf():
    names = set(build("qwen3-tiny").state_dict())
    assert {"embed_tokens.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= names
    assert "lm_head.weight" not in names  # tied
    assert "lm_head.weight" in build("llama-tiny").state_dict()
    assert "layers.0.self_attn.q_norm.weight" not in build("llama-tiny").state_dict()


def test_bf16_params_logits_and_fp32_loss():
    model = build("llama-tiny", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tokens = tokens_for(model.args, 2, 5, 0)
    assert model(tokens).dtype == torch.bfloat16
    assert model.loss(tokens, tokens).dtype == torch.float32


# ---------------------------------------------------------------- validation
def test_size_errors_name_the_field():
    args = get_config("qwen3-tiny")
    with pytest.raises(InvarianceError, match="vocab_size"):
        check_model_sizes(args.replace(vocab_size=260), 1, 8)
    with pytest.raises(InvarianceError, match="intermediate_size"):
        check_model_sizes(args.replace(intermediate_size=100), 1, 8)
    with pytest.raises(InvarianceError, match="hidden_size"):
        check_model_sizes(args.replace(hidden_size=60), 1, 8)
    check_model_sizes(args, 8, 8)  # TP above the 4 KV heads: each replicated on 2 ranks
    with pytest.raises(InvarianceError, match="num_kv_heads=3 and is not a multiple"):
        check_model_sizes(args.replace(num_heads=12, num_kv_heads=3), 4, 8)
    with pytest.raises(InvarianceError, match="num_kv_heads=6 is not divisible"):
        check_model_sizes(args.replace(num_heads=12, num_kv_heads=6), 4, 8)
    with pytest.raises(InvarianceError, match="leaves"):
        Transformer(args, leaves=3)
    with pytest.raises(ValueError, match="row_strategy"):
        Transformer(args, row_strategy="ring")


def test_input_errors():
    model = build("llama-tiny")
    tokens = tokens_for(model.args, 1, 4, 0)
    with pytest.raises(ValueError, match="several keys at position 1"):  # a packed row needs its mask
        model(tokens, positions=torch.tensor([[0, 1, 1, 2]]))
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        model(tokens[0])
    cache = model.new_cache(1, 3)
    with pytest.raises(ValueError, match="max_len=3"):
        model(tokens, cache=cache)
    with pytest.raises(ValueError, match="kv_heads"):
        KVCache(1, 4, 1, 2, 8).append(0, torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8),
                                      torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(KeyError, match="known"):
        get_config("gpt-tiny")


def test_from_hf_config_variants():
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, hidden_act="silu")
    llama = ModelArgs.from_hf_config({**base, "architectures": ["LlamaForCausalLM"], "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, "dtype": "bfloat16"})
    assert (llama.family, llama.head_dim, llama.rope_theta, llama.dtype) == ("llama", 16, 5e5, torch.bfloat16)
    assert llama.rope_scaling["rope_type"] == "llama3" and "rope_theta" not in llama.rope_scaling
    legacy = ModelArgs.from_hf_config({**base, "architectures": ["LlamaForCausalLM"], "rope_theta": 1e4,
                                       "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64}})
    assert legacy.rope_scaling == {**llama.rope_scaling} and legacy.rope_theta == 1e4
    qwen = ModelArgs.from_hf_config({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32,
                                     "tie_word_embeddings": True}, dtype=torch.float32)
    assert qwen.qk_norm and qwen.head_dim == 32 and qwen.tie_word_embeddings and qwen.rope_scaling is None
    mistral = ModelArgs.from_hf_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4})
    assert mistral.sliding_window == 4 and not mistral.qk_norm
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        ModelArgs.from_hf_config({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        ModelArgs.from_hf_config({**base, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
                                  "max_window_layers": 1})
    with pytest.raises(NotImplementedError, match="yarn"):
        ModelArgs.from_hf_config({**base, "architectures": ["LlamaForCausalLM"],
                                  "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
