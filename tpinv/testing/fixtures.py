"""Small test fixtures: a thread-count block and a tiny model with decisive logits."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["num_threads", "sharpened_model"]


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
