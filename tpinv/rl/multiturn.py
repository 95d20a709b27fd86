"""Multi-turn conversations: turn-by-turn rollout, and one packed training pass with the same bits.

Turn ``t``'s context is every earlier turn's user tokens, its reasoning (unless that turn
drops it) and its answer, then turn ``t``'s user tokens; the policy generates reasoning and
answer after it.  :func:`rollout_conversations` generates turn by turn with the engine's KV
cache (each turn's context is rebuilt and prefilled, so a dropped reasoning leaves no trace).
:func:`pack_conversations` lays all turns of a conversation in one row: a turn's tokens that
extend the previous turn's sequence share its slots, the rest get new slots whose position ids
restart where the turn's own context puts them, and a 2D mask shows each query exactly its
turn's context.  Because attention's key-block grid follows positions
(:func:`tpinv.ops.attention` with ``k_pos``) and every other layer is row-invariant, the
packed pass gives every generated token the log-prob bits of the rollout
(:func:`packed_log_probs`) -- at any TP size of either side and any batch size.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from tpinv.engine import Engine, Request, SamplingParams
from tpinv.distributed.groups import LOCAL
from tpinv.engine.sampling import vocab_log_probs
from tpinv.layers import vocab_parallel_log_probs

__all__ = ["Turn", "turn_prompt", "rollout_conversations", "Packed", "pack_conversations",
           "packed_log_probs", "packed_logits"]


@dataclasses.dataclass
class Turn:
    """One turn: the user's tokens, then the policy's reasoning and answer (with their log-probs)."""

    user: list[int]
    reasoning: list[int] = dataclasses.field(default_factory=list)
    answer: list[int] = dataclasses.field(default_factory=list)
    drop_reasoning: bool = False
    logprobs: Optional[torch.Tensor] = None   # rollout log-probs of reasoning + answer
    top_ids: Optional[torch.Tensor] = None    # rollout's top-1 token at each generated position

    @property
    def generated(self) -> list[int]:
        return self.reasoning + self.answer


def turn_prompt(turns: Sequence[Turn], t: int) -> list[int]:
    """The context turn ``t`` is generated after (earlier reasoning dropped where asked)."""
    ids: list[int] = []
    for s in turns[:t]:
        ids += s.user + ([] if s.drop_reasoning else s.reasoning) + s.answer
    return ids + list(turns[t].user)


def rollout_conversations(engine: Engine, users: Sequence[Sequence[Sequence[int]]], *, reasoning_tokens: int,
                          answer_tokens: int, drop_reasoning: Sequence[bool],
                          sampling: SamplingParams = SamplingParams(0.0), prefix: str = "conv") -> list[list[Turn]]:
    """Generate every conversation turn by turn (conversations batched together in each turn).

    ``users[c][t]`` are conversation ``c``'s user tokens of turn ``t``; each turn generates
    ``reasoning_tokens + answer_tokens`` tokens (EOS ignored), the first ``reasoning_tokens``
    of them being the reasoning that ``drop_reasoning[t]`` removes from later contexts.
    """
    n_turns = len(drop_reasoning)
    if any(len(u) != n_turns for u in users):
        raise ValueError(f"every conversation needs {n_turns} user turns (one per drop_reasoning entry)")
    convs = [[] for _ in users]
    for t in range(n_turns):
        for c, conv in enumerate(convs):
            conv.append(Turn(list(users[c][t]), drop_reasoning=bool(drop_reasoning[t])))
        requests = [Request(f"{prefix}{c}-turn{t}", turn_prompt(conv, t), max_tokens=reasoning_tokens + answer_tokens,
                            sampling=sampling, ignore_eos=True, top_logprobs=1) for c, conv in enumerate(convs)]
        for conv, result in zip(convs, engine.generate(requests)):
            turn = conv[t]
            turn.reasoning, turn.answer = result.token_ids[:reasoning_tokens], result.token_ids[reasoning_tokens:]
            turn.logprobs, turn.top_ids = result.logprobs, result.top_token_ids[:, 0]
    return convs


@dataclasses.dataclass
class Packed:
    """Rows of packed conversations and where each generated token is scored.

    ``tokens``, ``positions`` ``[B, S]``; ``mask`` ``[B, S, S]`` (query row sees key column);
    ``query_slots[c][t]`` / ``targets[c][t]``: the slot whose logits score turn ``t``'s
    generated tokens of conversation ``c``, and those tokens.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    query_slots: list[list[list[int]]]
    targets: list[list[list[int]]]


def _pack_one(turns: Sequence[Turn]):
    tokens, positions, contexts = [], [], []       # contexts[slot]: the slots it sees
    prev_seq, prev_slots = [], []
    slots_out, targets_out = [], []
    for t, turn in enumerate(turns):
        prompt = turn_prompt(turns, t)
        seq = prompt + turn.generated
        shared = 0
        while shared < min(len(seq), len(prev_seq)) and seq[shared] == prev_seq[shared]:
            shared += 1
        slots = prev_slots[:shared]
        for i in range(shared, len(seq)):
            slots.append(len(tokens))
            tokens.append(seq[i])
            positions.append(i)
            contexts.append(slots[:i + 1])
        slots_out.append([slots[j - 1] for j in range(len(prompt), len(seq))])
        targets_out.append(list(turn.generated))
        prev_seq, prev_slots = seq, slots
    return tokens, positions, contexts, slots_out, targets_out


def pack_conversations(convs: Sequence[Sequence[Turn]]) -> Packed:
    """Pack each conversation in one row (right-padded; padding slots see only themselves)."""
    packs = [_pack_one(c) for c in convs]
    S = max(len(p[0]) for p in packs)
    B = len(packs)
    tokens = torch.zeros(B, S, dtype=torch.int64)
    positions = torch.zeros(B, S, dtype=torch.int64)
    mask = torch.eye(S, dtype=torch.bool).repeat(B, 1, 1)
    for b, (tok, pos, ctx, _, _) in enumerate(packs):
        tokens[b, :len(tok)] = torch.tensor(tok)
        positions[b, :len(pos)] = torch.tensor(pos)
        for i, seen in enumerate(ctx):
            mask[b, i, seen] = True
    return Packed(tokens, positions, mask, [p[3] for p in packs], [p[4] for p in packs])


def packed_logits(model, packed: Packed, *, vanilla: bool = False,
                  logits_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Full-vocabulary logits ``[B, S, V]`` of the packed rows (call on every rank of the group);
    with ``logits_index [B, n]`` those slots' only, ``[B, n, V]`` (the same bits as those rows)."""
    from tpinv.models.vanilla import vanilla_forward
    forward = (lambda *a, **k: vanilla_forward(model, *a, **k)) if vanilla else model
    with torch.no_grad():
        return forward(packed.tokens, packed.positions, mask=packed.mask, gather_logits=True,
                       logits_index=logits_index)


def _query_index(packed: Packed) -> tuple[torch.Tensor, list[list[slice]]]:
    """Every row's scored slots, concatenated turn after turn (rows padded with slot 0), and per
    row and turn where that turn's slots sit in the concatenation."""
    flat, spans = [], []
    for slots_c in packed.query_slots:
        row, where = [], []
        for slots in slots_c:
            where.append(slice(len(row), len(row) + len(slots)))
            row.extend(int(i) for i in slots)
        flat.append(row)
        spans.append(where)
    width = max(1, max(len(r) for r in flat))
    index = torch.zeros(len(flat), width, dtype=torch.int64)
    for b, row in enumerate(flat):
        index[b, :len(row)] = torch.tensor(row, dtype=torch.int64)
    return index, spans


def packed_log_probs(model, packed: Packed, *, vanilla: bool = False
                     ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Per conversation and turn: fp32 log-probs of the generated tokens and the top-1 token ids.

    The invariant path scores a row as the engine does (exact full-vocabulary logits, the
    training path's vocabulary log-softmax); ``vanilla`` uses the plain forward and
    ``torch.log_softmax``.
    """
    index, spans = _query_index(packed)
    logits = packed_logits(model, packed, vanilla=vanilla, logits_index=index)   # the scored slots only
    lps, tops = [], []
    for b, (spans_c, targets_c) in enumerate(zip(spans, packed.targets)):
        lp_c, top_c = [], []
        for span, targets in zip(spans_c, targets_c):
            rows = logits[b, span]
            tgt = torch.tensor(targets, dtype=torch.int64)
            if vanilla:
                lp = torch.log_softmax(rows.float(), -1).gather(-1, tgt[:, None])[:, 0]
            else:
                lp = vocab_parallel_log_probs(rows, tgt, tp_group=LOCAL, leaves=model.leaves)  # full-vocabulary rows
            full = torch.log_softmax(rows.float(), -1) if vanilla else vocab_log_probs(rows.float(), model.leaves)
            lp_c.append(lp.float())
            top_c.append(torch.sort(full, dim=-1, descending=True, stable=True)[1][:, 0])  # the engine's top-1
        lps.append(lp_c)
        tops.append(top_c)
    return lps, tops
