"""The invariant DTensor plan with TP above the KV-head count: KV heads replicated.

Tiny HF Qwen3 / Llama / Mistral with 8 query heads and 2 KV heads.  At TP=4 each KV head's
k/v projection rows are held by 2 ranks (``(Shard(0), Replicate())`` on the TP mesh
unflattened to ``(kv, replica)``), at TP=8 by 4.  Asserted: logits, loss and every gradient
(gathered to the full tensor) have TP=1's bits on every rank, equal to tpinv's own
Transformer; KV-cache decoding on the replicated head gives the full forward's bits; tpinv's
Transformer sharded by the plan at TP=4 too.  Controls that differ by construction: without
the query-head gather each replica's k/v gradient misses the other replicas' query heads;
the replicas' gradients added (as a ``Partial`` reduction would) are twice the gradient.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

transformers = pytest.importorskip("transformers")

import dtensor_kv_cases as kv_cases  # noqa: E402
import dtensor_cases as cases  # noqa: E402
from tpinv.core.contract import InvarianceError  # noqa: E402
from tpinv.dtensor import validate  # noqa: E402
from tpinv.dtensor.styles import replica_mesh  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks  # noqa: E402

#: The plan's replica mesh is ``DeviceMesh._unflatten``'s (absent from torch 2.6-2.8, where the plan
#: refuses TP above the KV-head count: test_replica_mesh_refused_without_unflatten).
needs_unflatten = pytest.mark.skipif(
    not hasattr(DeviceMesh, "_unflatten"),
    reason=f"replicating KV heads in the DTensor plan needs DeviceMesh._unflatten, which torch {torch.__version__} lacks")

KV_WEIGHTS = ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight")


@pytest.fixture(scope="module")
def runs():
    inputs = kv_cases.make_inputs()
    ranks = run_ranks(kv_cases.worker, 4, inputs, timeout=500)
    return {tp: [ranks[r][tp] for r in range(tp)] for tp in (1, 2, 4)}, inputs


def _same(a, b, where):
    assert_same_bits(a["logits"], b["logits"], f"{where}: logits")
    assert_same_bits(a["loss"], b["loss"], f"{where}: loss")
    assert a["grads"].keys() == b["grads"].keys(), where
    for name, g in b["grads"].items():
        assert_same_bits(a["grads"][name], g, f"{where}: grad of {name}")


def _tpinv_reference(family, inputs):
    model, state = kv_cases.tpinv_model(family, inputs)
    model.load_state_dict(state, strict=True)
    return cases.tpinv_run(model, inputs)


@pytest.mark.slow
@needs_unflatten
@pytest.mark.parametrize("family", kv_cases.FAMILIES)
def test_replicated_kv_heads_same_bits_as_tp1(runs, family):
    out, inputs = runs
    ref = out[1][0][(family, "fp32")]
    assert len(ref["grads"]) >= 20
    for tp in (2, 4):
        for rank, res in enumerate(out[tp]):
            _same(res[(family, "fp32")], ref, f"{family} TP={tp} rank {rank}")
    ours = _tpinv_reference(family, inputs)
    _same(cases.strip_model_prefix(ref), ours, f"{family}: HF invariant TP=1 vs tpinv's Transformer")


@pytest.mark.slow
@needs_unflatten
def test_replicated_layout_and_bf16_and_decode(runs):
    out, _ = runs
    heads, kv_heads, local_shape, placements, mesh_shape = out[4][0]["k_proj"]
    assert (heads, kv_heads) == (2, 1)
    assert local_shape == (8, 64)  # mistral: one KV head of head_dim 64 / 8 heads
    assert placements == (Shard(0), Replicate()) and mesh_shape == (2, 2)
    assert out[2][0]["k_proj"][3] == (Shard(0),)  # TP=2 splits the 2 KV heads: no replication
    ref = out[1][0][("qwen3", "bf16")]
    for rank, res in enumerate(out[4]):
        _same(res[("qwen3", "bf16")], ref, f"bf16 TP=4 rank {rank}")
        dec = res[("mistral", "decode")]
        assert_same_bits(dec["decoded"], dec["full"], f"mistral decode TP=4 rank {rank}")
        assert_same_bits(dec["full"], out[1][0][("mistral", "decode")]["full"], f"mistral TP=4 rank {rank}")


@pytest.mark.slow
@needs_unflatten
def test_tpinv_transformer_under_plan_replicates(runs):
    out, inputs = runs
    ours = _tpinv_reference("qwen3", inputs)
    for tp in (1, 2, 4):
        for rank, res in enumerate(out[tp]):
            assert res["tpinv-under-plan"]["local_kv_heads"] == max(1, 2 // tp)
            _same(res["tpinv-under-plan"], ours, f"tpinv Transformer under the plan, TP={tp} rank {rank}")


@pytest.mark.slow
@needs_unflatten
def test_controls_differ_by_construction(runs):
    out, _ = runs
    ref = out[1][0][("llama", "fp32")]
    for rank, res in enumerate(out[4]):
        control = res["control-no-gather"]
        # each query head's output needs only its own KV head: the forward keeps its bits ...
        assert_same_bits(control["logits"], ref["logits"], f"control logits rank {rank}")
        # ... but each replica's k/v gradients lack the other replica's query heads
        for name in KV_WEIGHTS:
            assert_bits_differ(control["grads"][name], ref["grads"][name], f"{name} without the gather")
    # adding the replicas' (identical) gradients, as a Partial -> Replicate reduction would, doubles them
    for name in KV_WEIGHTS:
        g = out[4][0][("llama", "fp32")]["grads"][name]
        assert_bits_differ(g + g, ref["grads"][name], f"{name}: replicas' gradients added")


@pytest.mark.slow
@needs_unflatten
def test_tp8_replicated_kv_heads_same_bits_as_tp1():
    """TP=8 with 2 KV heads (4 replicas each) against TP=1 in the parent, qwen3 fp32."""
    inputs = kv_cases.make_inputs(names=("qwen3",))
    ranks = run_ranks(kv_cases.worker_tp8, 8, inputs, timeout=500)
    ours = _tpinv_reference("qwen3", inputs)
    for rank, res in enumerate(ranks):
        _same(cases.strip_model_prefix(res[("qwen3", "fp32")]), ours, f"TP=8 rank {rank} vs tpinv TP=1")


def test_validate_replicated_kv_heads():
    model = cases.hf_model("llama", kv_cases.kv_config("llama"))
    assert validate(model, 4, "invariant").prefix == "model."   # 4 ranks, 2 KV heads: 2 replicas
    assert validate(model, 8, "invariant").prefix == "model."
    with pytest.raises(InvarianceError, match="plan='invariant', which replicates"):
        validate(model, 4, "default")
    with pytest.raises(InvarianceError, match="plan='invariant', which replicates"):
        validate(model, 4, "numerically_stable")
    three = cases.hf_model("llama", cases.hf_config("llama", num_attention_heads=12, num_key_value_heads=3,
                                                    hidden_size=96))
    with pytest.raises(InvarianceError, match="num_kv_heads=3"):
        validate(three, 4, "invariant")                          # 4 is not a multiple of 3 KV heads


class _NamedMesh:
    """A stand-in for a 4-rank TP mesh named ``tp`` (``replica_mesh`` reads only these)."""
    mesh_dim_names = ("tp",)

    def size(self):
        return 4


class _UnflattenableMesh(_NamedMesh):
    def _unflatten(self, dim, sizes, names):
        return ("unflattened", dim, sizes, names)


def test_replica_mesh_refused_without_unflatten():
    with pytest.raises(InvarianceError, match=r"needs DeviceMesh._unflatten, which torch .* lacks; use TP <= 2"):
        replica_mesh(_NamedMesh(), 2)
    # control: a mesh that has it is unflattened to (kv, replica)
    assert replica_mesh(_UnflattenableMesh(), 2) == ("unflattened", 0, (2, 2), ("tp_kv", "tp_kv_replica"))
