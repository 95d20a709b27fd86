"""Models, inputs and the spawned per-rank run of tests/distributed/test_dtensor.py.

Tiny HF models (vocab 256, hidden 64, 2 layers, 8 heads / 4 KV heads so TP=4 keeps whole
KV heads) are drawn once in the parent; every rank loads the same weights.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from tpinv.dtensor import cross_entropy, parallelize
from tpinv.models import ModelArgs, Transformer
from tpinv.testing import record_ops

FAMILIES = ("qwen3", "llama", "mistral")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
B, S = 2, 7  # S > mistral's window of 4
#: Ops that must not run under the invariant plan (BLAS, torch's softmax and SiLU).
VANILLA_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::_softmax",
               "aten::_log_softmax", "aten::silu", "aten::sigmoid", "aten::embedding_dense_backward"}
#: torch's functional collectives that DTensor's redistributions dispatch.
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = ("_c10d_functional::all_reduce", "_c10d_functional::reduce_scatter_tensor",
                                          "_c10d_functional::all_gather_into_tensor")
COLLECTIVES = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER)
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=512,
            initializer_range=0.1, attn_implementation="eager")
PAD = 7  # llama-bias's padding_idx; the inputs hold this token
CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM")}
#: name -> (family, config fields beyond TINY)
MODELS = {"qwen3": ("qwen3", dict(intermediate_size=192, head_dim=16, tie_word_embeddings=True)),
          "llama": ("llama", dict(intermediate_size=176)),
          "mistral": ("mistral", dict(intermediate_size=160, sliding_window=4)),
          "llama-bias": ("llama", dict(intermediate_size=176, attention_bias=True, pad_token_id=PAD))}


def hf_config(name: str, **overrides):
    family, extra = MODELS[name]
    return getattr(transformers, CLASSES[family][0])(**{**TINY, **extra, **overrides})


@functools.lru_cache(maxsize=None)
def shared_config(name: str):
    """One config object per model name (building HF configs is slow; none is mutated)."""
    return hf_config(name)


def hf_model(name: str, config, state=None):
    model = getattr(transformers, CLASSES[MODELS[name][0]][1])(config)
    if state is not None:
        model.load_state_dict(state)
    return model


def make_inputs() -> dict:
    gen = torch.Generator().manual_seed(5)
    states = {}
    for name in MODELS:
        torch.manual_seed(0)
        model = hf_model(name, hf_config(name))
        with torch.no_grad():  # non-trivial norm weights and biases
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                elif pname.endswith(".bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        states[name] = model.state_dict()
    tokens = torch.randint(0, 256, (B, S), generator=gen)
    tokens[0, 2] = PAD
    return {"states": states, "tokens": tokens, "targets": torch.randint(0, 256, (B, S), generator=gen),
            "weights": torch.rand(B, S, generator=gen)}  # d(loss)/d(token loss): non-uniform


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def grads(model) -> dict:
    return {n: full(p.grad) for n, p in model.named_parameters()}


def strip_model_prefix(result: dict) -> dict:
    return {**result, "grads": {n.removeprefix("model."): g for n, g in result["grads"].items()}}


def tpinv_model(family: str, dtype: str, state=None, group=None) -> Transformer:
    """tpinv's Transformer on the HF weights (HF names minus ``model.``; a tied lm_head is the embedding)."""
    args = ModelArgs.from_hf_config(hf_config(family).to_dict(), dtype=DTYPES[dtype])
    model = Transformer(args, tp_group=group)
    if state is not None:
        weights = {n.removeprefix("model."): t.to(DTYPES[dtype]) for n, t in state.items()
                   if not (n == "lm_head.weight" and args.tie_word_embeddings)}
        model.load_state_dict(weights, strict=True)
    return model


def tpinv_run(model: Transformer, inputs: dict) -> dict:
    logits = model(inputs["tokens"], gather_logits=True).detach()
    loss = model.loss(inputs["tokens"], inputs["targets"])
    loss.backward(inputs["weights"])
    return {"logits": logits, "loss": loss.detach(), "grads": grads(model)}


def tpinv_reference(family: str, dtype: str, inputs: dict) -> dict:
    """tpinv's own model, TP=1, in this process."""
    return tpinv_run(tpinv_model(family, dtype, inputs["states"][family]), inputs)


def _hf(name, dtype, inputs, mesh=None, plan=None, **kwargs):
    model = hf_model(name, shared_config(name), inputs["states"][name]).to(DTYPES[dtype])
    return model if mesh is None else parallelize(model, mesh, plan, **kwargs)


def _hf_run(model, inputs, loss_fn, backward=True) -> dict:
    logits = model(inputs["tokens"], use_cache=False).logits
    loss = loss_fn(logits, inputs["targets"])
    if backward:
        loss.backward(inputs["weights"])
    return {"logits": full(logits), "loss": full(loss), "grads": grads(model) if backward else {},
            "placement": logits.placements if isinstance(logits, DTensor) else None}


def _count(log, names) -> dict:
    return {n: log.count(n) for n in names}


def _collectives(model, inputs) -> dict:
    """How many of each cross-rank op the forward and the backward dispatched, and the gradients."""
    with record_ops() as fwd:
        loss = plain_ce(model(inputs["tokens"], use_cache=False).logits, inputs["targets"])
    with record_ops() as bwd:
        loss.backward(inputs["weights"])
    return {"forward": _count(fwd, COLLECTIVES), "backward": _count(bwd, COLLECTIVES), "grads": grads(model)}


def plain_ce(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(B, S)


def _decode(model, inputs) -> dict:
    """Prefill S-1 tokens into an HF DynamicCache, decode the last: the full forward's bits."""
    tokens = inputs["tokens"]
    with torch.no_grad():
        whole = model(tokens, use_cache=False).logits[:, -1]
        cache = transformers.DynamicCache(config=model.config)
        model(tokens[:, :-1], past_key_values=cache, use_cache=True)
        last = model(tokens[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1]
    return {"full": whole, "decoded": last}


def _errors(mesh, inputs) -> dict:
    out = {}
    for case in ("twice", "missing", "plan", "leaves", "labels"):
        model = _hf("llama", "fp32", inputs)
        try:
            if case == "labels":  # HF's own loss on vocabulary-sharded logits
                parallelize(model, mesh, "invariant", shard_logits=True)(inputs["tokens"], labels=inputs["targets"])
            elif case == "twice":
                parallelize(parallelize(model, mesh, "invariant"), mesh, "invariant")
            elif case == "missing":
                del model.model.layers[1].mlp.up_proj
                parallelize(model, mesh, "invariant")
            elif case == "plan":
                parallelize(model, mesh, "rowwise")
            else:
                parallelize(model, mesh, "numerically_stable", leaves=4)
            out[case] = "no error"
        except Exception as err:  # noqa: BLE001 - the test reads the type and message
            out[case] = f"{type(err).__name__}: {err}"
    return out


def run_cases(mesh, solo_group, inputs: dict) -> dict:
    """Every case on one TP mesh; ``solo_group`` is a one-rank group (tpinv's Transformer is
    built unsharded, then the plan shards it)."""
    out = {}
    for family in FAMILIES:
        for dtype in DTYPES:
            out[(family, "invariant", dtype)] = _hf_run(_hf(family, dtype, inputs, mesh, "invariant"),
                                                        inputs, cross_entropy)
            sharded = _hf(family, dtype, inputs, mesh, "invariant", shard_logits=True)
            out[(family, "invariant-shard-logits", dtype)] = _hf_run(sharded, inputs, cross_entropy)
            if mesh.size() == 1:
                out[(family, "hf-plain", dtype)] = _hf_run(_hf(family, dtype, inputs), inputs, plain_ce, False)
        out[(family, "decode")] = _decode(_hf(family, "fp32", inputs, mesh, "invariant"), inputs)
        if mesh.size() == 1:
            out[(family, "hf-plain-decode")] = _decode(_hf(family, "fp32", inputs), inputs)
        out[(family, "default", "fp32")] = _hf_run(_hf(family, "fp32", inputs, mesh, "default"),
                                                   inputs, plain_ce, False)
        for plan in ("numerically_stable", "default"):
            out[(family, plan, "collectives")] = _collectives(_hf(family, "fp32", inputs, mesh, plan), inputs)
        ours = parallelize(tpinv_model(family, "fp32", inputs["states"][family], solo_group), mesh, "invariant")
        out[(family, "tpinv-heads")] = (ours.layers[0].self_attn.local_heads,
                                        ours.layers[0].self_attn.local_kv_heads)
        out[(family, "tpinv-invariant", "fp32")] = tpinv_run(ours, inputs)
    # q/k/v/o biases and a padding_idx (its row gets no gradient).
    out[("llama-bias", "invariant", "fp32")] = _hf_run(_hf("llama-bias", "fp32", inputs, mesh, "invariant"),
                                                       inputs, cross_entropy)
    for plan in ("invariant", "numerically_stable", "default"):
        attn = _hf("llama", "fp32", inputs, mesh, plan).model.layers[0].self_attn
        out[("heads", plan)] = (attn.num_heads, attn.num_key_value_heads,
                                (attn.config.num_attention_heads, attn.config.num_key_value_heads))
    with record_ops() as log:
        _hf_run(_hf("qwen3", "fp32", inputs, mesh, "invariant", shard_logits=True), inputs, cross_entropy)
    out["ops-invariant"] = set(log.names)
    with record_ops() as log:
        _hf_run(_hf("qwen3", "fp32", inputs, mesh, "default"), inputs, plain_ce, False)
    out["ops-default"] = set(log.names)
    logits = _hf("llama", "fp32", inputs, mesh, "invariant", shard_logits=True)(inputs["tokens"]).logits
    with torch.no_grad(), loss_parallel():  # torch's vocab-parallel loss: plain all-reduces
        out["torch-loss-parallel"] = full(F.cross_entropy(logits.flatten(0, 1), inputs["targets"].flatten(),
                                                          reduction="none"))
    out["tpinv-loss-parallel"] = full(cross_entropy(logits, inputs["targets"]).detach())
    if mesh.size() == 2:
        out["errors"] = _errors(mesh, inputs)
    return out


def worker(rank: int, world: int, inputs: dict) -> dict:
    """Four ranks; TP=4 on all, TP=2 on ranks 0-1 (a sub-mesh), TP=1 on rank 0: ``{tp: cases}``."""
    if world != 4:
        raise ValueError(f"the worker runs in a world of 4 ranks, got {world}")
    meshes = {4: init_device_mesh("cpu", (4,)),
              2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"],
              1: init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))["tp"]}
    solo = meshes[1].get_group()
    return {tp: run_cases(mesh, solo, inputs) for tp, mesh in sorted(meshes.items()) if rank < tp}
