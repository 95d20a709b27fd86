"""GRPO pieces: a verifiable arithmetic task, group advantages, the policy loss, weight sync.

The invariant it serves: the engine's rollout log-prob of every sampled token and the
trainer's log-prob of the same token are the same bits, whatever TP size each side runs at,
so the importance ratio ``exp(train_lp - rollout_lp)`` is exactly 1 and the update is truly
on-policy.  :func:`sync_weights` copies the trainer's full weights into the engine's shards
bit for bit (gathers and broadcasts move bytes, no arithmetic); the vanilla control uses the
same loop with the plain forward on both sides.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from tpinv.distributed.reduce import gather_shards
from tpinv.io.checkpoint import shard_index
from tpinv.layers.linear_cross_entropy import LOG_PROB_CHUNK_TOKENS

__all__ = ["arithmetic_prompt", "arithmetic_reward", "group_advantages", "policy_loss", "full_weights",
           "sync_weights", "sequence_log_probs"]

NEWLINE = 10


def arithmetic_prompt(a: int, b: int) -> list[int]:
    return list(f"{a}+{b}=".encode("ascii"))


def arithmetic_reward(a: int, b: int, generated: Sequence[int]) -> float:
    """1.0 when the generation is exactly the sum followed by a newline (or the end), else 0.0."""
    ids = list(generated)
    if NEWLINE in ids:
        ids = ids[:ids.index(NEWLINE)]
    try:
        return 1.0 if bytes(ids).decode("ascii") == str(a + b) else 0.0
    except (UnicodeDecodeError, ValueError):
        return 0.0


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``[prompts, group]`` rewards -> advantages ``r - mean(group)`` (Dr. GRPO: no std division)."""
    return rewards - rewards.mean(-1, keepdim=True)


def policy_loss(train_lp: torch.Tensor, rollout_lp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_eps: float = 0.2, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PPO-clipped surrogate with the rollout as behaviour policy, mean over valid tokens.

    ``train_lp``, ``rollout_lp``, ``mask`` ``[B, T]``; ``advantages`` ``[B]``; ``weights``
    (optional, ``[B, T]``, no grad) multiply each token's term: a mismatch correction from
    :mod:`tpinv.rl.mismatch`.  On the invariant path the ratio is exactly 1 and this is the
    plain policy gradient.
    """
    ratio = torch.exp(train_lp - rollout_lp)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if weights is not None:
        surrogate = surrogate * weights
    return -(surrogate * mask).sum() / mask.sum().clamp(min=1)


def sequence_log_probs(model, prompts: Sequence[Sequence[int]], generations: Sequence[Sequence[int]], *,
                       vanilla: bool = False, chunk_tokens: Optional[int] = LOG_PROB_CHUNK_TOKENS
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-probs ``[B, T]`` of each generation (with grad) and the bool mask of its tokens.

    One right-padded forward without a cache; token ``j`` of generation ``i`` is scored at
    position ``len(prompt_i) + j - 1``.  ``vanilla``: the plain forward and ``torch.log_softmax``.
    ``chunk_tokens``: the output layer and the log-softmax run that many tokens at a time, in the
    forward and the backward (:func:`tpinv.layers.linear_cross_entropy`: the same bits, at most
    ``chunk_tokens x V/C`` logits at once; ``None``: all at once).
    """
    from tpinv.models.vanilla import vanilla_forward
    rows = [list(p) + list(g) for p, g in zip(prompts, generations)]
    width = max(len(r) for r in rows)
    T = max(len(g) for g in generations)
    padded = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        padded[i, :len(r)] = torch.tensor(r)
    padded = padded.to(next(model.parameters()).device)
    tokens, targets = padded[:, :-1], padded[:, 1:]
    if vanilla:
        logits = vanilla_forward(model, tokens, gather_logits=True).float()
        lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    else:
        lp = model.log_probs(tokens, targets, chunk_tokens=chunk_tokens)
    out = lp.new_zeros(len(rows), T)
    mask = torch.zeros(len(rows), T, dtype=torch.bool, device=lp.device)
    for i, (p, g) in enumerate(zip(prompts, generations)):
        out[i, :len(g)] = lp[i, len(p) - 1:len(p) - 1 + len(g)]
        mask[i, :len(g)] = True
    return out, mask


def full_weights(model, group: Optional[dist.ProcessGroup]) -> dict[str, torch.Tensor]:
    """The model's full parameters (TP shards gathered along their partition dims; a shard that
    ``R`` ranks hold, a replicated KV head's, counted once)."""
    out = {}
    for name, p in model.named_parameters():
        dim = int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None
        t = p.detach()
        if dim is not None and group is not None and dist.get_world_size(group) > 1:
            t = gather_shards(t, group, dim, getattr(p, "tpinv_replicas", 1))
        out[name] = t.clone()
    return out


def sync_weights(full: Optional[dict[str, torch.Tensor]], engine_model, specs: dict[str, tuple], *,
                 src: int = 0, device: Optional[torch.device] = None) -> None:
    """Broadcast ``full`` (held by global rank ``src``) to every rank and load this rank's shards.

    ``engine_model`` is this rank's engine shard (None on a rank without one); ``specs`` maps
    every parameter name to its full ``(shape, dtype)`` (known to all ranks).  Bytes only:
    the engine then holds exactly the trainer's bits.  ``device``: where a rank that does not
    hold ``full`` receives each tensor (default CPU; a CUDA device under NCCL).
    """
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    params = dict(engine_model.named_parameters()) if engine_model is not None else {}
    tp, rank = getattr(engine_model, "tp_size", 1), getattr(engine_model, "tp_rank", 0)
    for name, (shape, dtype) in specs.items():
        t = full[name].contiguous() if full is not None else torch.empty(shape, dtype=dtype, device=device)
        if distributed:
            dist.broadcast(t, src=src)
        if name in params:
            p = params[name]
            dim = int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None
            with torch.no_grad():
                p.copy_(t[shard_index(t.shape, dim, tp, rank, name, getattr(p, "tpinv_replicas", 1))])
