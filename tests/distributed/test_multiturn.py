"""Multi-turn: one packed training pass scores every generated token with the rollout's bits.

Four conversations of three turns (the first and third drop their reasoning from later
contexts) are generated turn by turn by the engine (KV cache, sampled) at TP 1 and 2 and at
batch 1 and 4; one packed pass per TP size (2D visibility mask, per-turn position ids)
scores every rollout.  Every generated token's log-prob is bitwise equal to the rollout's,
whichever TP size generated and whichever scored.  Negative control: the vanilla engine and
the vanilla packed pass on the same weights disagree on some log-prob bits (their top-1
agreement is printed, the metric of the multi-turn context write-up).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tpinv.engine import Engine, SamplingParams
from tpinv.rl.multiturn import pack_conversations, packed_log_probs, rollout_conversations
from tpinv.testing import assert_bits_differ, assert_same_bits, record_ops, run_ranks, sharpened_model

DROP = (True, False, True)
REASONING, ANSWER = 4, 3


def users():
    gen = torch.Generator().manual_seed(21)
    return [[torch.randint(0, 256, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
             for _ in DROP] for _ in range(4)]


def rollout(model, batch, vanilla=False):
    engine = Engine(model, max_batch=batch, max_context=128, vanilla=vanilla)
    return rollout_conversations(engine, users(), reasoning_tokens=REASONING, answer_tokens=ANSWER,
                                 drop_reasoning=DROP, sampling=SamplingParams(0.9, top_k=50, seed=7))


def flat(per_conv):
    return torch.cat([x for conv in per_conv for x in conv])


def case(rank, world_size, to_score):
    """Rollouts at batch 1 and 4, vanilla rollouts, and packed scores of ``to_score``."""
    group = dist.group.WORLD if world_size > 1 else None
    model = sharpened_model("llama-tiny", torch.bfloat16, group)
    outs = {b: rollout(model, b) for b in (1, 4)}
    vanilla = rollout(model, 4, vanilla=True)
    with record_ops() as log:
        scores = {k: packed_log_probs(model, pack_conversations(c)) for k, c in to_score.items()}
    assert not to_score or "tpinv::attention_packed" in log
    van_scores = packed_log_probs(model, pack_conversations(vanilla), vanilla=True)
    return outs, scores, vanilla, van_scores


@pytest.mark.slow
def test_packed_multiturn_equals_turn_by_turn_rollout(capsys):
    torch.set_num_threads(1)
    tp1, _, van1, van1_scores = case(0, 1, {})
    assert [len(t.reasoning + t.answer) for t in tp1[4][0]] == [REASONING + ANSWER] * 3
    packed = pack_conversations(tp1[4])
    assert packed.tokens.shape[1] < sum(len(t.user) + REASONING + ANSWER for t in tp1[4][0]) * 2
    ranks = run_ranks(case, 2, {"tp1": tp1[4]}, timeout=300)
    tp2, tp2_scored, _, _ = ranks[0]
    _, tp1_scored, _, _ = case(0, 1, {"tp2": tp2[4], "tp1": tp1[4]})
    rollout_lp = {f"tp{t}-b{b}": flat([[turn.logprobs for turn in conv] for conv in r[b]])
                  for t, r in ((1, tp1), (2, tp2)) for b in (1, 4)}
    for key in rollout_lp:  # the engine: the same tokens and log-probs at every TP and batch
        assert_same_bits(rollout_lp[key], rollout_lp["tp1-b4"], f"rollout {key} vs tp1-b4")
    for scorer, scored in (("tp1", tp1_scored), ("tp2", tp2_scored)):
        for source, lps in scored.items():
            assert_same_bits(flat(lps[0]), rollout_lp[f"{source}-b4"],
                             f"packed pass at {scorer} vs turn-by-turn rollout at {source}")
    # Control: the vanilla engine vs the vanilla packed pass.
    van_roll = flat([[turn.logprobs for turn in conv] for conv in van1])
    van_packed = flat(van1_scores[0])
    assert_bits_differ(van_packed, van_roll, "vanilla packed pass vs vanilla rollout")
    top_roll = flat([[turn.top_ids for turn in conv] for conv in van1])
    agree = float((flat(van1_scores[1]) == top_roll).float().mean())
    equal = float((van_packed.view(torch.int32) == van_roll.view(torch.int32)).float().mean())
    with capsys.disabled():
        print(f"\nvanilla multi-turn: top-1 agreement {agree:.4f}, bitwise-equal log-probs {equal:.4f} "
              f"over {van_roll.numel()} tokens")
