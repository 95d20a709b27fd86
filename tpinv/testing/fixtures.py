"""Small test fixtures: a thread-count block, a tiny model with decisive logits, packed document rows."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["num_threads", "sharpened_model", "packed_document_rows"]


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
