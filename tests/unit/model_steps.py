"""A training step's bits, for tests that compare two ways of running the same model: a seeded model
with random weights and the step's loss and every parameter gradient."""
from __future__ import annotations

import torch

from tpinv.models import Transformer, get_config


def random_model(name: str, dtype: torch.dtype, **overrides) -> Transformer:
    """``name``'s config with weights drawn from a fixed seed (scaled so every layer matters)."""
    torch.manual_seed(0)
    model = Transformer(get_config(name, dtype=dtype, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def step_tensors(model: Transformer, batch: int = 2, seq: int = 24) -> list[torch.Tensor]:
    """The loss and every parameter's gradient of one step on fixed tokens."""
    tokens = torch.randint(0, model.args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    loss = model.loss(tokens, tokens.roll(1, 1)).mean()
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]
