"""The engine at TP 1, 2 and 4 x batch sizes 1, 3 and 8 (spawned gloo ranks): the same bits everywhere.

For tiny Qwen3 (fp32), Llama (bf16) and Mistral (fp32, sliding window), four requests -- two
greedy, two sampled with a fixed seed -- are placed in random cache slots and arrive at
random steps.  Across all nine (TP x batch) configurations every prompt has one unique output
and zero maximum probability divergence (TBIK paper metrics), the raw and sampled log-probs
are bitwise equal, every rank of a group draws the same tokens, and the raw log-probs equal
the training forward's at another TP size (token_mult_prob_error exactly 1.0, K3 KL exactly 0).

Negative controls on the same weights and requests: the vanilla engine (BLAS, SDPA, plain
all_reduce) gives more than one output or a non-zero divergence for some prompt, and its
log-probs disagree with the vanilla trainer's (token_mult_prob_error > 1).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from tpinv.engine import Engine, Request, SamplingParams
from tpinv.engine.metrics import (count_unique_outputs, k3_kl, max_probability_divergence, token_mult_prob_error,
                                  trainer_log_probs)
from tpinv.models import Transformer, get_config
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks, sharpened_model

FAMILIES = {"qwen3-tiny": torch.float32, "llama-tiny": torch.bfloat16, "mistral-tiny": torch.float32}
BATCHES = (1, 3, 8)
TPS = (1, 2, 4)
MODES = (False, True)  # vanilla?
N_REQUESTS = 4


def build(name, group) -> Transformer:
    return sharpened_model(name, FAMILIES[name], group)


def requests() -> list[Request]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(N_REQUESTS):
        n = int(torch.randint(3, 10, (1,), generator=gen))      # longer than mistral's window of 5
        prompt = torch.randint(0, 256, (n,), generator=gen).tolist()
        sampling = SamplingParams(0.0) if i % 2 == 0 else SamplingParams(0.9, top_k=50, top_p=0.9, seed=1234)
        out.append(Request(f"req-{i}", prompt, max_tokens=4, sampling=sampling, top_logprobs=5))
    return out


def schedule(tp: int, batch: int) -> tuple[list[int], list[int]]:
    """Random slot order and arrival steps, different for every configuration."""
    gen = torch.Generator().manual_seed(100 * tp + batch)
    return torch.randperm(batch, generator=gen).tolist(), torch.randint(0, 4, (N_REQUESTS,), generator=gen).tolist()


def run_tp(rank, world_size, rollouts_to_score, generate=True):
    """Every case at one TP size: generations per (family, vanilla, batch), trainer scores of given rollouts."""
    group = dist.group.WORLD if world_size > 1 else None
    gens, scores = {}, {}
    for name in FAMILIES:
        model = build(name, group)
        for vanilla in MODES:
            for batch in BATCHES if generate else ():
                slots, arrivals = schedule(world_size, batch)
                engine = Engine(model, max_batch=batch, slot_order=slots, vanilla=vanilla, max_context=32)
                results = engine.generate(requests(), arrival_steps=arrivals)
                gens[name, vanilla, batch] = [(r.token_ids, r.logprobs, r.sampled_logprobs, r.top_logprobs.exp())
                                              for r in results]
            seqs = rollouts_to_score.get((name, vanilla))
            if seqs:
                scores[name, vanilla] = trainer_log_probs(model, seqs, vanilla=vanilla)
    return gens, scores


@contextlib.contextmanager
def one_thread():
    """The in-process TP=1 run uses one thread, like the spawned ranks (tiny ops: threads only cost)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def rollouts(gens, batch=3):
    """``(prompt, generated)`` pairs of one configuration, per (family, vanilla)."""
    prompts = [r.prompt for r in requests()]
    return {(name, vanilla): [(p, g[0]) for p, g in zip(prompts, gens[name, vanilla, batch])]
            for name in FAMILIES for vanilla in MODES}


def test_engine_is_invariant_across_tp_and_batch_and_matches_the_trainer():
    with one_thread():
        tp1, _ = run_tp(0, 1, {})
    to_score = rollouts(tp1)
    per_tp = {1: tp1}
    scored_by = {}
    for tp in TPS[1:]:
        ranks = run_ranks(run_tp, tp, to_score, timeout=240)
        for r, (gens, _) in enumerate(ranks[1:], 1):       # every rank drew the same tokens
            for key, outs in gens.items():
                assert [o[0] for o in outs] == [o[0] for o in ranks[0][0][key]], f"TP={tp} rank {r} {key}"
        per_tp[tp] = ranks[0][0]
        scored_by[tp] = ranks[0][1]
    # TP=1 trainer scores the TP=4 engine's rollouts (engine and trainer at different TP sizes)
    with one_thread():
        _, scored_by[1] = run_tp(0, 1, rollouts(per_tp[4]), False)
    n_prompts = len(requests())
    vanilla_spread = []
    for name in FAMILIES:
        for vanilla in MODES:
            configs = [per_tp[tp][name, vanilla, b] for tp in TPS for b in BATCHES]
            unique = [count_unique_outputs([c[i][0] for c in configs]) for i in range(n_prompts)]
            divergence = [max_probability_divergence([c[i][3] for c in configs]) for i in range(n_prompts)]
            if vanilla:
                vanilla_spread.append(max(unique) > 1 or max(divergence) > 0)
                continue
            assert unique == [1] * n_prompts, f"{name}: unique outputs {unique}"
            assert divergence == [0.0] * n_prompts, f"{name}: max probability divergence {divergence}"
            ref = configs[0]
            for c in configs[1:]:
                for i in range(n_prompts):
                    assert_same_bits(c[i][1], ref[i][1], str(name))
                    assert_same_bits(c[i][2], ref[i][2], str(name))
                    assert_same_bits(c[i][3], ref[i][3], str(name))
            assert any(len(set(o[0])) > 1 for o in ref)
            assert any(float(o[2].abs().max()) > 0 for o in ref)     # sampled requests ran through the sampler
    assert any(vanilla_spread), "negative control: vanilla gave identical outputs in every configuration"
    for engine_tp, trainer_tp in ((1, 2), (1, 4), (4, 1)):
        for name in FAMILIES:
            for vanilla in MODES:
                gen_lp = torch.cat([o[1] for o in per_tp[engine_tp][name, vanilla, 3]])
                train_lp = torch.cat(scored_by[trainer_tp][name, vanilla])
                err, kl = token_mult_prob_error(gen_lp, train_lp), k3_kl(gen_lp, train_lp)
                where = f"{name} engine TP={engine_tp} trainer TP={trainer_tp} vanilla={vanilla}"
                if vanilla:
                    assert err > 1.0, where
                    assert_bits_differ(gen_lp, train_lp, str(where))
                else:
                    assert_same_bits(gen_lp, train_lp, str(where))
                    assert err == 1.0 and kl == 0.0, where
