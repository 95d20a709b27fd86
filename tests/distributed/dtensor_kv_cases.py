"""The spawned per-rank run of tests/distributed/test_dtensor_kv_replication.py.

The tiny HF models of :mod:`dtensor_cases` with 2 KV heads (8 query heads): at TP=4 each KV
head is held by 2 ranks, at TP=8 by 4 (TP=2 splits them, no replication).  Every TP size
runs in one spawn: TP=N on a named mesh of all ranks, smaller sizes on sub-meshes.
"""
from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import init_device_mesh

import dtensor_cases as cases
import tpinv.dtensor.hf_modules as hf_modules
from tpinv.dtensor import cross_entropy, parallelize
from tpinv.models import ModelArgs, Transformer

KV_HEADS = 2
FAMILIES = ("qwen3", "llama", "mistral")


@functools.lru_cache(maxsize=None)
def kv_config(name: str, kv_heads: int = KV_HEADS):
    return cases.hf_config(name, num_key_value_heads=kv_heads)


def make_inputs(kv_heads: int = KV_HEADS, names=FAMILIES) -> dict:
    """Weights of each model with ``kv_heads`` KV heads, drawn once; the tokens of dtensor_cases."""
    gen = torch.Generator().manual_seed(11)
    states = {}
    for name in names:
        torch.manual_seed(1)
        model = cases.hf_model(name, kv_config(name, kv_heads))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        states[name] = model.state_dict()
    base = cases.make_inputs()
    return {"states": states, "kv_heads": kv_heads, "tokens": base["tokens"], "targets": base["targets"],
            "weights": base["weights"]}


def hf(name, dtype, inputs, mesh=None):
    model = cases.hf_model(name, kv_config(name, inputs["kv_heads"]), inputs["states"][name])
    model = model.to(cases.DTYPES[dtype])
    return model if mesh is None else parallelize(model, mesh, "invariant")


def tpinv_model(name, inputs, group=None) -> tuple[Transformer, dict]:
    """tpinv's Transformer (fp32) built at ``group``'s size, and the full weights to load (tpinv names)."""
    args = ModelArgs.from_hf_config(kv_config(name, inputs["kv_heads"]).to_dict(), dtype=torch.float32)
    model = Transformer(args, tp_group=group)
    full_state = {n.removeprefix("model."): t for n, t in inputs["states"][name].items()
                  if not (n == "lm_head.weight" and args.tie_word_embeddings)}
    return model, full_state


def run(model, inputs) -> dict:
    return cases._hf_run(model, inputs, cross_entropy)


def _no_query_gather(mesh, inputs) -> dict:
    """Control: replicated KV heads without the query-head gather -- each replica attends with
    its own query heads only, so its k/v gradients miss the other replicas' query heads."""
    saved = hf_modules.gather_replica_heads, hf_modules.split_replica_heads
    hf_modules.gather_replica_heads = hf_modules.split_replica_heads = lambda x, group, replicas: x
    try:
        return run(hf("llama", "fp32", inputs, mesh), inputs)
    finally:
        hf_modules.gather_replica_heads, hf_modules.split_replica_heads = saved


def run_cases(mesh, inputs: dict, families=FAMILIES, extras: bool = True) -> dict:
    out = {"size": mesh.size()}
    for family in families:
        out[(family, "fp32")] = run(hf(family, "fp32", inputs, mesh), inputs)
    if not extras:
        return out
    out[("qwen3", "bf16")] = run(hf("qwen3", "bf16", inputs, mesh), inputs)
    model = hf("mistral", "fp32", inputs, mesh)  # sliding window + HF cache on the replicated head
    out[("mistral", "decode")] = cases._decode(model, inputs)
    attn = model.model.layers[0].self_attn
    kv_weight = attn.k_proj.weight
    out["k_proj"] = (attn.num_heads, attn.num_key_value_heads, tuple(kv_weight.to_local().shape),
                     tuple(kv_weight.placements), tuple(kv_weight.device_mesh.shape))
    if mesh.size() > inputs["kv_heads"]:
        out["control-no-gather"] = _no_query_gather(mesh, inputs)
    return out


def tpinv_under_plan(mesh, solo_group, inputs) -> dict:
    model, state = tpinv_model("qwen3", inputs, solo_group)
    model.load_state_dict(state, strict=True)
    model = parallelize(model, mesh, "invariant")
    return {**cases.tpinv_run(model, inputs), "local_kv_heads": model.layers[0].self_attn.local_kv_heads}


def worker(rank: int, world: int, inputs: dict) -> dict:
    """Four ranks: TP=4 (2 replicas per KV head) on all, TP=2 on ranks 0-1, TP=1 on rank 0."""
    meshes = {4: init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
              2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"],
              1: init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))["tp"]}
    solo = meshes[1].get_group()
    out = {}
    for tp, mesh in sorted(meshes.items()):
        if rank < tp:
            out[tp] = run_cases(mesh, inputs)
            out[tp]["tpinv-under-plan"] = tpinv_under_plan(mesh, solo, inputs)
    return out


def worker_tp8(rank: int, world: int, inputs: dict) -> dict:
    """Eight ranks, TP=8 with ``inputs['kv_heads']`` KV heads; one family, fp32."""
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    return run_cases(mesh, inputs, families=("qwen3",), extras=False)
