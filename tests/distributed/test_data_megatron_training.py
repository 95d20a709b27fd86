"""Training on a Megatron-preprocessed blend (tools/preprocess_data.py, in the test) at TP 1/2/4 x
DP 1/2 on spawned gloo ranks: the same per-step loss bits and final weights, and every rank of
every layout holds the same rows of the global batches (the order a function of the seed and the
sample index only); a run stopped after step 1 and resumed gives the rest of the curve.
Negative controls: the vanilla path gives other curves at TP1xDP2 than at TP1xDP1 (another
summation order of the micro-batch gradients by construction), and at TP2xDP2 than at TP4xDP1."""
from __future__ import annotations

import hashlib
import io
import os

import pytest

from tpinv.testing import run_ranks
from tpinv.testing.runs import assert_runs_differ, assert_same_run, run_summary
from tpinv.testing.corpus import tiny_corpus_jsonl, tiny_tokenizer_json
from tpinv.training import TrainConfig
from tpinv.testing.scripts import load_script

BASE = dict(model="qwen3-tiny", seq_len=8, global_batch=8, micro_batch=2, steps=3, lr=1e-2, warmup=1, eval_every=0,
            dtype="fp32")


def run_layouts(rank, world_size, configs):
    """Train each ``(tp, overrides)``; every rank returns its view (curves are the same on every rank)."""
    from tpinv.distributed.parallel import ParallelDims
    from tpinv.training import Trainer
    out = []
    for tp, overrides in configs:
        cfg = TrainConfig(**dict(BASE, **overrides))
        stream = io.StringIO()
        trainer = Trainer(cfg, ParallelDims(tp=tp).build(), stream=stream)
        rows = trainer.dataset.batch(0, cfg.steps * cfg.global_batch)
        data_sha = hashlib.sha256(b"".join(t.numpy().tobytes() for t in (rows.tokens, rows.targets, rows.loss_mask)))
        result = trainer.run()
        out.append({"curve": [(r["loss_hex"], r["grad_norm_hex"]) for r in result["history"]],
                    "loss_tokens": [r["loss_tokens"] for r in result["history"]],
                    "sha": result["weights_sha256"], "master": result["master_sha256"],
                    "data": data_sha.hexdigest(), "log": stream.getvalue()})
    return out


def _preprocess(tmp_path):
    tool = load_script("tools/preprocess_data.py")
    tok = tiny_tokenizer_json(str(tmp_path))
    prefixes = []
    for name, upper in (("a", False), ("b", True)):
        corpus = tiny_corpus_jsonl(str(tmp_path / f"{name}.jsonl"), name, upper=upper)
        assert tool.main(["--input", corpus, "--output-prefix", str(tmp_path / "data" / name), "--tokenizer", tok,
                          "--append-eod", "--log-interval", "0"]) == 0
        prefixes.append(str(tmp_path / "data" / f"{name}_text_document"))
    return tok, prefixes




@pytest.mark.slow
def test_a_megatron_blend_trains_to_the_same_bits_at_every_tp_x_dp_layout(tmp_path):
    pytest.importorskip("megatron.core")
    tok, (a, b) = _preprocess(tmp_path)
    data = dict(data_path=["0.7", a, "0.3", b], tokenizer=tok, data_cache_path=str(tmp_path / "cache"))
    v = dict(data, vanilla=True)
    world4 = run_ranks(run_layouts, 4, [(2, data), (4, data), (2, v), (4, v)], timeout=600)
    world2 = run_ranks(run_layouts, 2, [(1, data), (1, v)], timeout=300)
    ckpt = str(tmp_path / "ckpt")
    (tp1, v_tp1, stopped, resumed), = run_ranks(run_layouts, 1, [
        (1, data), (1, v), (1, dict(data, save=ckpt, save_every=1, stop_after=1)), (1, dict(data, load=ckpt))],
        timeout=300)
    tp2dp2, tp4, v_tp2dp2, v_tp4 = world4[0]
    tp1dp2, v_tp1dp2 = world2[0]
    assert "data megatron" in tp1["log"] and "data megatron" in tp2dp2["log"]  # the indexed blend was read
    assert tp1["loss_tokens"] == [BASE["global_batch"] * BASE["seq_len"]] * BASE["steps"]  # loss on every token
    assert len(tp1["curve"]) == BASE["steps"]
    assert_same_run(tp2dp2, tp1, "TP2xDP2 vs TP1xDP1")
    assert_same_run(tp4, tp1, "TP4xDP1 vs TP1xDP1")
    assert_same_run(tp1dp2, tp1, "TP1xDP2 vs TP1xDP1")
    assert stopped["curve"] == tp1["curve"][:1]  # a resume reads the rest of the same global batches
    assert_same_run(resumed, dict(tp1, curve=tp1["curve"][1:]), "stopped after step 1 and resumed")
    views = [r[i] for world in (world4, world2) for r in world for i in range(len(r))] + [tp1, v_tp1]
    assert {view["data"] for view in views} == {tp1["data"]}, "a rank or layout saw other rows"
    assert_runs_differ(v_tp1dp2, v_tp1, "vanilla TP1xDP2 vs TP1xDP1")
    assert_runs_differ(v_tp2dp2, v_tp4, "vanilla TP2xDP2 vs TP4xDP1")
