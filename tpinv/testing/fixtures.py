"""Small test fixtures: a thread-count block, a tiny model with decisive logits, packed document rows,
a packed multi-turn conversation."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["num_threads", "sharpened_model", "packed_document_rows", "packed_conversation", "pack_row", "place_row",
           "attention_inputs"]


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)``; the previous count is restored."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def sharpened_model(name: str, dtype: torch.dtype = torch.float32, tp_group=None):
    """A named tiny model with decisive logits, for tests that compare generated tokens.

    Seeded init (the same full weights at every TP size), norm weights drawn around 1 and
    projections/embeddings scaled by 5, so greedy and sampled choices are not near-ties.
    """
    from tpinv.models import Transformer, get_config

    torch.manual_seed(0)
    model = Transformer(get_config(name, dtype=dtype), tp_group=tp_group)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("proj.weight") or pname.endswith("embed_tokens.weight"):
                p.mul_(5.0)
    return model.eval()


def packed_document_rows(lengths_per_row, device=None):
    """``(positions [B, T], mask [B, T, T])`` of rows packed with documents: row ``b`` holds documents
    of the lengths ``lengths_per_row[b]`` (equal totals per row), each at positions ``0..n-1`` and
    seeing only itself (block-diagonal visibility)."""
    pos, mask = [], []
    for lengths in lengths_per_row:
        pos.append(torch.cat([torch.arange(n) for n in lengths]))
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        mask.append(doc[:, None] == doc[None, :])
    return torch.stack(pos).to(device), torch.stack(mask).to(device)


def packed_conversation(user, reasoning, answer, drop):
    """``(positions [n], mask [n, n])`` of one multi-turn conversation packed in one row by
    :func:`tpinv.rl.multiturn.pack_conversations`: turn ``t`` has ``user[t]``, ``reasoning[t]`` and
    ``answer[t]`` tokens (distinct ids) and ``drop[t]`` drops its reasoning from the later turns'
    contexts, whose restated tokens get new slots at the positions their context gives them."""
    from tpinv.rl.multiturn import Turn, pack_conversations  # the RL layer: imported only when used
    ids = iter(range(1, 1 << 30))
    turns = [Turn([next(ids) for _ in range(u)], [next(ids) for _ in range(r)], [next(ids) for _ in range(a)], d)
             for u, r, a, d in zip(user, reasoning, answer, drop)]
    packed = pack_conversations([turns])
    return packed.positions[0], packed.mask[0]


def pack_row(parts, total, device=None):
    """``(positions [total], mask [total, total], starts)``: the parts ``(positions [n], mask [n, n])``
    laid one after another from slot 0 (``starts``: their first slots), each seeing only itself, and
    the slots after them one causal document at positions ``0, 1, ...``."""
    used = sum(p.shape[0] for p, _ in parts)
    if used > total:
        raise ValueError(f"the parts take {used} slots, more than the row's {total}")
    rest = total - used
    parts = list(parts) + ([(torch.arange(rest), torch.ones(rest, rest, dtype=torch.bool))] if rest else [])
    pos, mask, starts = torch.zeros(total, dtype=torch.int64), torch.zeros(total, total, dtype=torch.bool), []
    s = 0
    for p, m in parts:
        n = p.shape[0]
        pos[s:s + n], mask[s:s + n, s:s + n] = p, m
        starts.append(s)
        s += n
    return pos.to(device), mask.to(device), starts[:len(starts) - (1 if rest else 0)]


def place_row(background, part, row, start):
    """The tensors ``background`` (each ``[B, H, T, ...]``) with row 0 of the matching ``part`` tensor
    written at slots ``start ..`` of batch row ``row`` (copies; the inputs are not changed)."""
    out = []
    for bg, p in zip(background, part):
        bg = bg.clone()
        bg[row, :, start:start + p.shape[2]] = p[0]
        out.append(bg)
    return tuple(out)


def attention_inputs(B, Hkv, g, T, D, seed, dtype=torch.float32, device=None):
    """``(q, k, v, dO, dlse)`` of ``B`` rows of ``T`` slots from one seeded generator: ``q``, ``dO``
    ``[B, Hkv*g, T, D]`` and ``k``, ``v`` ``[B, Hkv, T, D]`` in ``dtype``, ``dlse [B, Hkv*g, T]`` fp32."""
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, Hkv * g, T, D, generator=gen).to(dtype).to(device) for _ in range(2))
    k, v = (torch.randn(B, Hkv, T, D, generator=gen).to(dtype).to(device) for _ in range(2))
    return q, k, v, do, torch.randn(B, Hkv * g, T, generator=gen).to(device)
