"""A decode step captured once as a CUDA graph and replayed.

The invariant kept: a replay launches the eager step's kernels, in the eager step's order, on
the same buffers, so its logits are the eager step's logits bit for bit (and so the prefill's:
``tests/gpu/test_cuda_graph.py``).  The value checks that cannot run inside a capture run on
the inputs before every replay instead.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from tpinv.core.capture import capture, check_warmup

__all__ = ["DecodeGraph"]


class DecodeGraph:
    """``forward(tokens [B, 1], positions [B, 1], num_valid [B]) -> logits`` on CUDA, replayed.

    ``forward`` is one decode step against ``cache`` (anything with ``batch``, ``max_len``):
    it writes each row's key and value at its position and grows the length of the rows
    whose ``num_valid`` is 1, all in place.  The first call captures it: ``warmup`` eager
    runs on a side stream (Triton compiles there), then the capture, all with the first
    call's tokens and positions and ``num_valid = 0`` -- they write the keys and values the
    real step writes at the same slots and move no length.  Every call then checks its inputs
    on the host (token ids in ``[0, vocab_size)``, positions in ``[0, max_len)``, ``num_valid``
    in {0, 1}; one transfer when they live on the GPU), copies them into the graph's input
    buffers and replays.  The returned logits are the graph's output buffer: read them before
    the next call, which overwrites them.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], cache, vocab_size: int, *,
                 device: Optional[torch.device] = None, warmup: int = 2):
        device = torch.device(device) if device is not None else cache.lengths.device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}; run the eager step on "
                             f"{device.type}")
        check_warmup(warmup)   # here too: a bad setting fails at construction, not at the first step
        self.forward, self.cache, self.vocab_size, self.warmup = forward, cache, int(vocab_size), warmup
        B = cache.batch
        self.tokens = torch.zeros(B, 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(B, 1, dtype=torch.int64, device=device)
        self.num_valid = torch.zeros(B, dtype=torch.int64, device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits: Optional[torch.Tensor] = None
        self.replays = 0

    def _check(self, tokens: torch.Tensor, positions: torch.Tensor, num_valid: torch.Tensor) -> None:
        B = self.cache.batch
        for name, t, shape in (("tokens", tokens, (B, 1)), ("positions", positions, (B, 1)),
                               ("num_valid", num_valid, (B,))):
            if t.dtype != torch.int64 or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be int64 of shape {list(shape)} (the cache's batch), "
                                 f"got {t.dtype} {list(t.shape)}")
        pairs = [torch.stack(torch.aminmax(t)) for t in (tokens, positions, num_valid)]
        if any(p.is_cuda for p in pairs):  # one transfer for all three
            pairs = [p.to(self.tokens.device) for p in pairs]
        ranges = torch.stack(pairs).tolist()
        for (low, high), name, end in zip(ranges, ("token id", "position", "num_valid"),
                                          (self.vocab_size, self.cache.max_len, 2)):
            if low < 0 or high >= end:
                raise ValueError(f"{name}s must lie in [0, {end}), got [{low}, {high}]")

    def _capture(self) -> None:
        valid = self.num_valid.clone()
        self.num_valid.zero_()
        try:
            self.graph, self.logits = capture(
                lambda: self.forward(self.tokens, self.positions, self.num_valid),
                warmup=self.warmup, device=self.tokens.device)
        finally:
            self.num_valid.copy_(valid)

    def reset(self) -> None:
        """Free the captured graph (the next call captures again).  A graph that holds NCCL
        collectives must be freed before ``destroy_process_group``, which otherwise waits on
        it (PyTorch issue 115388)."""
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.logits = None, None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, num_valid: torch.Tensor) -> torch.Tensor:
        self._check(tokens, positions, num_valid)
        with torch.no_grad():
            self.tokens.copy_(tokens)
            self.positions.copy_(positions)
            self.num_valid.copy_(num_valid)
            if self.graph is None:
                self._capture()
            self.graph.replay()
        self.replays += 1
        return self.logits
