"""DTensor TP plans on HF Qwen3 / Llama / Mistral and tpinv's Transformer, TP 1, 2, 4 (gloo).

One spawned run of four ranks computes every case at every TP size (TP=4 on the whole
mesh, TP=2 on a sub-mesh, TP=1 on a one-rank mesh; ``dtensor_cases.worker``).  Asserted:

* ``invariant``: logits, loss and every gradient (gathered to the full tensor) are bitwise
  equal across TP sizes and ranks, fp32 and bf16, with replicated or vocab-sharded logits,
  and equal to ``tpinv.models.Transformer`` (TP=1) on the same weights; tpinv ops ran and
  no BLAS / softmax / silu op did; KV-cache decoding gives the full forward's bits.
* ``numerically_stable``: its structure, not its bits -- the forward all-reduces no partial
  sums (only the embedding's exact one), the backward does (plain all-reduce /
  reduce-scatter of input-gradient partials), and Qwen3's q/k norm gradients cover only the
  rank's heads.  Its bits may change with TP on a given machine (torch's kernels on a slice).
* ``default`` (negative control): logits differ across TP.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

transformers = pytest.importorskip("transformers")

import dtensor_cases as cases  # noqa: E402
from tpinv.core.contract import InvarianceError  # noqa: E402
from tpinv.dtensor import validate  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks, same_bits

TPS = (1, 2, 4)
FAMILIES = cases.FAMILIES


@pytest.fixture(scope="module")
def runs():
    inputs = cases.make_inputs()
    ranks = run_ranks(cases.worker, 4, inputs, timeout=400)
    return {tp: [ranks[r][tp] for r in range(tp)] for tp in TPS}, inputs


def _same(a, b, where):
    assert_same_bits(a["logits"], b["logits"], f"{where}: logits")
    assert_same_bits(a["loss"], b["loss"], f"{where}: loss")
    assert a["grads"].keys() == b["grads"].keys(), where
    for name, g in b["grads"].items():
        assert_same_bits(a["grads"][name], g, f"{where}: grad of {name}")


def _differs(a, b) -> list[str]:
    return [n for n in b["grads"] if not same_bits(a["grads"][n], b["grads"][n])]


@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
@pytest.mark.parametrize("family", FAMILIES)
def test_invariant_plan_same_bits_at_every_tp(runs, family, dtype):
    out, _ = runs
    ref = out[1][0][(family, "invariant", dtype)]
    assert len(ref["grads"]) >= 20  # every parameter took part
    for tp in TPS:
        for rank, res in enumerate(out[tp]):
            _same(res[(family, "invariant", dtype)], ref, f"TP={tp} rank {rank}")
            _same(res[(family, "invariant-shard-logits", dtype)], ref, f"shard_logits TP={tp} rank {rank}")
            assert res[(family, "invariant-shard-logits", dtype)]["placement"] == (Shard(2),)


def test_invariant_plan_biases_and_padding_idx(runs):
    out, _ = runs
    ref = out[1][0][("llama-bias", "invariant", "fp32")]
    assert "model.layers.0.self_attn.o_proj.bias" in ref["grads"]
    assert not ref["grads"]["model.embed_tokens.weight"][cases.PAD].any()  # padding_idx: no gradient
    assert ref["grads"]["model.embed_tokens.weight"].abs().sum(-1).count_nonzero() > 5
    for tp in (2, 4):
        for rank, res in enumerate(out[tp]):
            _same(res[("llama-bias", "invariant", "fp32")], ref, f"TP={tp} rank {rank}")


@pytest.mark.parametrize("family", FAMILIES)
def test_default_plan_logits_differ(runs, family):
    """Negative control beside the test above: row-parallel all-reduces change the bits."""
    out, _ = runs
    ref = out[1][0][(family, "default", "fp32")]["logits"]
    for tp in (2, 4):
        assert_bits_differ(out[tp][0][(family, "default", "fp32")]["logits"], ref, f"TP={tp}")


@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
@pytest.mark.parametrize("family", FAMILIES)
def test_invariant_plan_equals_tpinv_model(runs, family, dtype):
    out, inputs = runs
    ours = cases.tpinv_reference(family, dtype, inputs)
    _same(cases.strip_model_prefix(out[1][0][(family, "invariant", dtype)]), ours, "HF invariant vs tpinv")
    # Negative control: the unparallelized HF model (plain torch ops) differs from tpinv's.
    assert_bits_differ(out[1][0][(family, "hf-plain", dtype)]["logits"], ours["logits"],
                       "out[1][0][family, 'hf-plain', dtype]['logits']")


@pytest.mark.parametrize("family", FAMILIES)
def test_tpinv_model_under_invariant_plan(runs, family):
    """tpinv's own Transformer, built at TP=1 and sharded by the plan: same bits as unsharded."""
    out, inputs = runs
    ours = cases.tpinv_reference(family, "fp32", inputs)
    for tp in TPS:
        for rank, res in enumerate(out[tp]):
            _same(res[(family, "tpinv-invariant", "fp32")], ours, f"TP={tp} rank {rank}")
            assert res[(family, "tpinv-heads")] == (8 // tp, 4 // tp)
    # Negative control: the same weights under the vanilla plan change with TP.
    default = [out[tp][0][(family, "default", "fp32")]["logits"] for tp in TPS]
    assert_bits_differ(default[0], default[1], 'default[0]')
    assert_bits_differ(default[0], default[2], 'default[0]')


def test_invariant_path_ran(runs):
    out, _ = runs
    for tp in (2, 4):
        ops = out[tp][0]["ops-invariant"]
        for name in ("tpinv::matmul_partial", "tpinv::attention", "tpinv::rms_norm", "tpinv::silu_mul",
                     "tpinv::apply_rope", "tpinv::sum_exp_partial", "tpinv::embedding_backward"):
            assert name in ops, name
        assert not ops & cases.VANILLA_OPS, sorted(ops & cases.VANILLA_OPS)
        # The check can fail: the default plan runs BLAS and torch's softmax / silu.
        assert out[tp][0]["ops-default"] & cases.VANILLA_OPS


def test_kv_cache_decode_matches_full_forward(runs):
    out, _ = runs
    for family in FAMILIES:
        for tp in TPS:
            res = out[tp][0][(family, "decode")]
            assert_same_bits(res["decoded"], res["full"], f"{family} TP={tp}")
        plain = out[1][0][(family, "hf-plain-decode")]  # negative control: HF's eager path
        assert_bits_differ(plain["decoded"], plain["full"], str(family))


def test_vocab_parallel_loss_same_bits_at_every_tp(runs):
    """The same vocab-sharded logits: tpinv's loss is equal at every TP size; torch's
    ``loss_parallel`` (plain all-reduces of the sums of exponentials) is not."""
    out, _ = runs
    ref = out[1][0]
    for tp in (2, 4):
        for rank, res in enumerate(out[tp]):
            assert_same_bits(res["tpinv-loss-parallel"], ref["tpinv-loss-parallel"], f"TP={tp} rank {rank}")
        assert_bits_differ(out[tp][0]["torch-loss-parallel"], ref["torch-loss-parallel"], f"TP={tp}")


@pytest.mark.parametrize("family", FAMILIES)
def test_numerically_stable_forward_sums_no_partials(runs, family):
    """What the column-only plan guarantees by construction: o_proj/down_proj gather their input
    instead of all-reducing partial sums, so the forward's only all-reduce is the embedding's
    (each element is one rank's row plus zeros: exact).  It does not promise equal bits across
    TP (a BLAS GEMM on an N-slice or a vectorised activation on a shorter row may round
    differently from the whole), so the bits are not asserted.  Negative control: the default
    plan all-reduces each row-parallel layer's partials."""
    out, _ = runs
    layers = cases.TINY["num_hidden_layers"]
    for tp in (2, 4):
        stable = out[tp][0][(family, "numerically_stable", "collectives")]["forward"]
        default = out[tp][0][(family, "default", "collectives")]["forward"]
        assert stable[cases.ALL_REDUCE] == 1 and stable[cases.REDUCE_SCATTER] == 0, f"TP={tp}: {stable}"
        assert stable[cases.ALL_GATHER] >= 2 * layers, f"TP={tp}: {stable}"
        assert default[cases.ALL_REDUCE] == 1 + 2 * layers, f"TP={tp}: {default}"


@pytest.mark.parametrize("family", FAMILIES)
def test_numerically_stable_backward_sums_partials(runs, family):
    """The column-only plan's backward adds the ranks' input-gradient partials with plain
    all-reduces / reduce-scatters (so its gradients may change with TP); the invariant plan
    runs none of them (its cross-rank sums are tree reductions of gathered fp32 partials)."""
    out, _ = runs
    for tp in (2, 4):
        stable = out[tp][0][(family, "numerically_stable", "collectives")]["backward"]
        assert stable[cases.ALL_REDUCE] + stable[cases.REDUCE_SCATTER] >= 2, f"TP={tp}: {stable}"
        assert not {cases.ALL_REDUCE, cases.REDUCE_SCATTER} & out[tp][0]["ops-invariant"], f"TP={tp}"
        if family == "qwen3":  # replicated q/k norm weights: each rank sums its own heads only
            r0, r1 = (out[tp][r][(family, "numerically_stable", "collectives")]["grads"]
                      ["model.layers.0.self_attn.q_norm.weight"] for r in (0, 1))
            assert_bits_differ(r0, r1, f"TP={tp} q_norm gradients of ranks 0 and 1")


def test_local_head_counts_set(runs):
    out, _ = runs
    for tp in TPS:
        for plan in ("invariant", "numerically_stable", "default"):
            heads, kv_heads, config_heads = out[tp][0][("heads", plan)]
            assert (heads, kv_heads) == (8 // tp, 4 // tp), (plan, tp)
            assert config_heads == (8, 4)  # the shared config is not mutated


def test_parallelize_errors(runs):
    out, _ = runs
    errors = out[2][0]["errors"]
    assert "InvarianceError" in errors["twice"] and "already parallelized" in errors["twice"]
    assert "ValueError" in errors["missing"] and "matches no module" in errors["missing"]
    assert "ValueError" in errors["plan"] and "numerically_stable" in errors["plan"]
    assert "ValueError" in errors["leaves"] and "takes none" in errors["leaves"]
    assert "ValueError" in errors["labels"] and "tpinv.dtensor.cross_entropy" in errors["labels"]


def test_validate_sizes():
    model = cases.hf_model("llama", cases.hf_config("llama"))
    assert validate(model, 4, "invariant").prefix == "model."
    assert validate(model, 8, "invariant").prefix == "model."  # 8 ranks, 4 KV heads: replicated
    with pytest.raises(InvarianceError, match="power of two"):
        validate(model, 3, "invariant")
    with pytest.raises(InvarianceError, match="num_kv_heads=4"):
        validate(model, 8, "default")
    odd = cases.hf_model("llama", cases.hf_config("llama", intermediate_size=180))
    with pytest.raises(InvarianceError, match="intermediate_size=180"):
        validate(odd, 2, "invariant")            # 180 is not a multiple of 8 leaves
    validate(odd, 2, "default")                  # no leaves in the vanilla plan
    with pytest.raises(ValueError, match="expected one of"):
        validate(model, 2, "rowwise")
    with pytest.raises(TypeError, match="ForCausalLM"):
        validate(torch.nn.Linear(8, 8), 2)
    with pytest.raises(TypeError, match="plan='invariant'"):
        validate(cases.tpinv_model("llama", "fp32"), 2, "default")
