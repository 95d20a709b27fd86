"""A contiguous KV cache whose slot ``j`` holds absolute position ``j`` of each request.

The invariant it keeps: attention always sees keys at their absolute slots, so the
block grid of :func:`tpinv.ops.attention` (blocks start at slots 0, B, 2B, ...) is the
same in a full forward, a chunked prefill and a decode step, and a query's result does
not depend on how its keys arrived.  Slots a query may not see (beyond its position, or
stale slots of a shorter request) contribute exact zeros, whatever they hold.

Per-request ``lengths`` say how many positions of each request are filled; they give the
default positions of the next tokens.  The cache holds this rank's KV heads only and is
inference-only (appended keys are detached).
"""
from __future__ import annotations

from typing import Optional

import torch

from tpinv.core.capture import check_range


class KVCache:
    """Keys and values ``[layers, batch, kv_heads, max_len, head_dim]`` plus per-request lengths."""

    def __init__(self, batch: int, max_len: int, layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None):
        for name, value in (("batch", batch), ("max_len", max_len), ("layers", layers),
                            ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCache {name}={value!r}: expected a positive int")
        shape = (layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=device)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def next_positions(self, num_tokens: int) -> torch.Tensor:
        """``[batch, num_tokens]`` int64: the positions that follow each request's length."""
        steps = torch.arange(num_tokens, dtype=torch.int64, device=self.lengths.device)
        return self.lengths[:, None] + steps[None, :]

    def check_positions(self, positions: torch.Tensor) -> None:
        """Shape, dtype and range of ``positions``; the range is read on the host (one sync),
        except inside a CUDA-graph capture, whose runner checks its inputs before each replay
        (:class:`tpinv.engine.decode_graph.DecodeGraph`)."""
        if positions.dtype != torch.int64 or positions.dim() != 2 or positions.shape[0] != self.batch:
            raise ValueError(f"positions must be int64 of shape [batch={self.batch}, S], got "
                             f"{positions.dtype} {list(positions.shape)}")
        check_range(positions, self.max_len, lambda low, high: ValueError(
            f"positions must lie in [0, max_len={self.max_len}) of the cache, got [{low}, {high}]; "
            f"build a longer cache"), "cache position")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
               check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` ``[batch, kv_heads, S, head_dim]`` at slots ``positions`` ``[batch, S]``.

        Returns the layer's whole cache ``(k, v)``, each ``[batch, kv_heads, max_len, head_dim]``.
        Positions must be distinct within a request.  ``check=False`` skips
        :meth:`check_positions` (a model checks a step's positions once, not per layer).
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is outside the cache's {self.num_layers} layers")
        expected = (self.batch, self.k.shape[2], positions.shape[-1], self.k.shape[4])
        if k.dim() != 4 or tuple(k.shape) != expected or v.shape != k.shape:
            raise ValueError(f"k and v must have shape [batch, kv_heads, S, head_dim] = {list(expected)}, "
                             f"got k {list(k.shape)}, v {list(v.shape)}")
        if k.dtype != self.k.dtype or v.dtype != self.v.dtype:
            raise TypeError(f"k and v must be {self.k.dtype} like the cache, got {k.dtype}, {v.dtype}")
        if check:
            self.check_positions(positions)
        B, H, S, D = k.shape
        index = positions[:, None, :, None].expand(B, H, S, D)
        self.k[layer].scatter_(2, index, k.detach())
        self.v[layer].scatter_(2, index, v.detach())
        return self.k[layer], self.v[layer]

    def advance(self, positions: torch.Tensor, num_valid: Optional[torch.Tensor] = None, *,
                check: bool = True) -> None:
        """Record that the first ``num_valid[b]`` (default all) of ``positions[b]`` are filled.

        Each request's length becomes at least one past its last recorded position; padded
        tokens beyond ``num_valid`` are not counted (their slots are overwritten later).
        ``lengths`` is updated in place (a captured decode step replays the update).
        """
        if check:
            self.check_positions(positions)
        S = positions.shape[1]
        if num_valid is None:
            valid = torch.ones_like(positions, dtype=torch.bool)
        else:
            if tuple(num_valid.shape) != (self.batch,):
                raise ValueError(f"num_valid must have shape [batch={self.batch}], got {list(num_valid.shape)}")
            steps = torch.arange(S, device=positions.device)
            valid = steps[None, :] < num_valid.to(positions.device)[:, None]
        last = torch.where(valid, positions + 1, 0).amax(dim=1) if S else torch.zeros_like(self.lengths)
        torch.maximum(self.lengths, last, out=self.lengths)

    def reset(self) -> None:
        """Forget every request (slots are overwritten by later appends)."""
        self.lengths.zero_()

    def __repr__(self) -> str:
        return (f"KVCache(batch={self.batch}, max_len={self.max_len}, layers={self.num_layers}, "
                f"kv_heads={self.k.shape[2]}, head_dim={self.k.shape[4]}, dtype={self.k.dtype})")
