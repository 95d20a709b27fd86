"""The engine and tools/check_invariance.py at TP=8 (8 gloo ranks), KV heads split and replicated.

``qwen3-kv8-tiny`` (one KV head per rank) and ``qwen3-kv2-tiny`` (each KV head cached on 4
ranks) generate four requests -- greedy and seeded sampling, random slots and arrival steps --
at TP 1 and 8 and batch 1 and 3: one unique output per prompt, zero maximum probability
divergence, bitwise equal log-probs, and every rank draws the same tokens.  Negative control:
the vanilla engine (BLAS, SDPA, plain all_reduce) on the same weights and requests moves
probabilities between those configurations.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from tpinv.engine import Engine
from tpinv.engine.metrics import count_unique_outputs, max_probability_divergence
from tpinv.testing import assert_same_bits, run_ranks, sharpened_model

import test_engine_tp as base  # the shared requests and schedules
from test_check_invariance import run_tool

NAMES = ("qwen3-kv8-tiny", "qwen3-kv2-tiny")
BATCHES = (1, 3)


def run_tp(rank, world_size):
    group = dist.group.WORLD if world_size > 1 else None
    out = {}
    for name in NAMES:
        model = sharpened_model(name, torch.float32, group)
        for vanilla in (False, True):
            for batch in BATCHES:
                slots, arrivals = base.schedule(world_size, batch)
                engine = Engine(model, max_batch=batch, slot_order=slots, vanilla=vanilla, max_context=32)
                results = engine.generate(base.requests(), arrival_steps=arrivals)
                out[name, vanilla, batch] = [(r.token_ids, r.logprobs, r.top_logprobs.exp()) for r in results]
    return out


@pytest.mark.slow
def test_engine_at_tp8_equals_tp1():
    with base.one_thread():
        tp1 = run_tp(0, 1)
    ranks = run_ranks(run_tp, 8, timeout=600)
    for r, gens in enumerate(ranks[1:], 1):
        for key, outs in gens.items():
            assert [o[0] for o in outs] == [o[0] for o in ranks[0][key]], f"TP=8 rank {r} {key}"
    n = len(base.requests())
    spread = []
    for name in NAMES:
        for vanilla in (False, True):
            configs = [per[name, vanilla, b] for per in (tp1, ranks[0]) for b in BATCHES]
            unique = [count_unique_outputs([c[i][0] for c in configs]) for i in range(n)]
            divergence = [max_probability_divergence([c[i][2] for c in configs]) for i in range(n)]
            if vanilla:
                spread.append(max(unique) > 1 or max(divergence) > 0)
                continue
            assert unique == [1] * n and divergence == [0.0] * n, f"{name}: {unique} {divergence}"
            for c in configs[1:]:
                for i in range(n):
                    assert_same_bits(c[i][1], configs[0][i][1], f"{name} log-probs of request {i}")
    assert all(spread), f"the vanilla engine did not move at TP=8 for some model: {spread}"


@pytest.mark.slow
def test_check_invariance_tool_at_tp8_with_replicated_kv_heads(tmp_path):
    out = tmp_path / "report.json"
    code = run_tool(["--model", "qwen3-kv2-tiny", "--tp", "1,8", "--batch", "1,3", "--prompts", "3",
                     "--new-tokens", "5", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    inv, van = report["paths"]["invariant"], report["paths"]["vanilla"]
    assert inv["avg_unique_outputs"] == 1.0 and inv["avg_max_prob_divergence"] == 0.0
    assert van["avg_max_prob_divergence"] > 0.0  # negative control
