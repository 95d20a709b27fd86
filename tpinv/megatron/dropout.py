"""Dropout whose mask is a function of (seed, site, call, global element index): TP-invariant.

Invariant kept: the mask of an element depends only on the dropout seed, the site (which
layer and which dropout in it), the number of earlier training calls of that site, and the
element's index in the *unsharded* tensor (a head or feature sharded across TP ranks is
indexed by its global position).  So a model gives the same bits at every TP size with
dropout on.  The mask is a counter-based integer hash computed with exact int64 tensor ops;
no random-number generator (and no megatron RNG tracker) is involved.  The hash and the
scaling are :mod:`tpinv.layers.dropout`'s, shared with tpinv's own models.

:func:`install_invariant_dropout` puts it into a megatron-core GPT model (embedding dropout,
attention dropout, both bias-dropout-adds of every layer) and refuses any dropout it cannot
replace, so the plain megatron RNG path never runs next to tpinv layers.

Under megatron's activation recompute (``tensor_parallel.checkpoint``: ``recompute_granularity``
"full" or "selective") a checkpointed forward runs twice, once without gradients and again during
backward.  The recomputed call must draw the mask of the call it repeats, not the next one: a
call made inside megatron's checkpoint forward records its call number, and its recompute (inside
the checkpoint, during backward) takes the numbers back in the order they were recorded -- the order
megatron's schedules run the backwards of a module's micro-batches.  So the masks, the loss and
the gradients are the bits of the run without recompute.
"""
from __future__ import annotations

import collections
import sys
from typing import Optional

import torch
import torch.distributed as dist

from tpinv.layers.dropout import apply_keep, dropout_key
from tpinv.layers.dropout import keep_mask as primitive_keep_mask

_M = 0xFFFFFFFF


def keep_mask(shape, p: float, seed: int, site: int, call: int, *, dim: Optional[int] = None, offset: int = 0,
              full: Optional[int] = None, device=None) -> torch.Tensor:
    """Boolean keep mask of the local ``shape``; along ``dim`` the local slice starts at global
    ``offset`` of a global size ``full`` (no ``dim``: the tensor is whole)."""
    gshape = list(shape)
    if dim is not None:
        gshape[dim] = full
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(shape))):
        ar = torch.arange(shape[d], dtype=torch.int64, device=device)
        if d == dim:
            ar = ar + offset
        idx = idx + (ar * stride).view([-1] + [1] * (len(shape) - 1 - d))
        stride *= gshape[d]
    return primitive_keep_mask(dropout_key(seed, site, call), (idx & _M, idx >> 32), p)


def invariant_dropout(x: torch.Tensor, p: float, seed: int, site: int, call: int, **where) -> torch.Tensor:
    """``x / (1 - p)`` where the mask keeps an element, else 0 (elementwise, exact)."""
    if p <= 0.0:
        return x
    if p >= 1.0:
        return torch.zeros_like(x)
    return apply_keep(x, keep_mask(x.shape, p, seed, site, call, device=x.device, **where), p)


def _megatron_checkpoint_phase() -> Optional[str]:
    """``"forward"`` inside megatron's checkpointed forward, ``"recompute"`` inside its recompute, else None."""
    mrandom = sys.modules.get("megatron.core.tensor_parallel.random")
    flag = getattr(mrandom, "is_checkpointing", None)
    if flag is None or not flag():
        return None
    # megatron runs bias-dropout-add under enable_grad even in the checkpointed forward: the
    # recompute is told apart by running inside the autograd engine's backward
    return "recompute" if torch._C._current_graph_task_id() != -1 else "forward"


class InvariantDropout(torch.nn.Module):
    """Drop-in for ``torch.nn.Dropout`` (``dim``/``tp_group``: the dim sharded across TP ranks)."""

    def __init__(self, p: float, *, seed: int, site: int, dim: Optional[int] = None, tp_group=None):
        super().__init__()
        self.p, self.seed, self.site, self.dim = float(p), int(seed), int(site), dim
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self.calls = 0
        self._to_recompute: collections.deque = collections.deque()  # call numbers of checkpointed forwards

    def _call_number(self) -> int:
        phase = _megatron_checkpoint_phase()
        if phase == "recompute":
            if not self._to_recompute:
                raise RuntimeError(f"dropout site {self.site}: a recomputed call without a recorded checkpointed "
                                   f"forward (megatron's recompute ran a forward it did not run before)")
            return self._to_recompute.popleft()
        call, self.calls = self.calls, self.calls + 1
        if phase == "forward":
            self._to_recompute.append(call)
        return call

    def forward(self, x: torch.Tensor, p: Optional[float] = None, training: Optional[bool] = None) -> torch.Tensor:
        p = self.p if p is None else float(p)
        if not (self.training if training is None else training) or p == 0.0:
            return x
        where = {}
        if self.dim is not None:
            n = x.shape[self.dim]
            where = dict(dim=self.dim, offset=self.tp_rank * n, full=n * self.tp_size)
        return invariant_dropout(x, p, self.seed, self.site, self._call_number(), **where)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}, dim={self.dim}, TP={self.tp_size}"


class InvariantBiasDropoutAdd(torch.nn.Module):
    """megatron's ``get_bias_dropout_add(training, fused)`` protocol with :class:`InvariantDropout`."""

    def __init__(self, *, seed: int, site: int):
        super().__init__()
        self.dropout = InvariantDropout(0.0, seed=seed, site=site)

    def forward(self, training: bool, fused: bool = False):
        def bias_dropout_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)
            return residual + self.dropout(x, prob, training)
        return bias_dropout_add


def _is_stock_bda(fn) -> bool:
    return getattr(fn, "__name__", "") == "get_bias_dropout_add"


def install_invariant_dropout(model: torch.nn.Module, *, tp_group, seed: int) -> int:
    """Replace every dropout of a megatron-core GPT model with the invariant one; returns how
    many sites were replaced.  Raises ``NotImplementedError`` for a dropout it cannot replace."""
    count = 0
    for name, module in list(model.named_modules()):
        layer = getattr(module, "layer_number", None)
        for attr, k in (("self_attn_bda", 0), ("mlp_bda", 1)):
            if layer is not None and _is_stock_bda(getattr(module, attr, None)):
                setattr(module, attr, InvariantBiasDropoutAdd(seed=seed, site=4 * layer + k))
                count += 1
        drop = getattr(module, "attention_dropout", None)
        if isinstance(drop, torch.nn.Dropout) and layer is not None:
            module.attention_dropout = InvariantDropout(drop.p, seed=seed, site=4 * layer + 2, dim=1,
                                                        tp_group=tp_group)
            count += 1
        drop = getattr(module, "embedding_dropout", None)
        if isinstance(drop, torch.nn.Dropout):
            module.embedding_dropout = InvariantDropout(drop.p, seed=seed, site=3)
            count += 1
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            raise NotImplementedError(
                f"{name} is a torch.nn.Dropout(p={module.p}) on megatron's RNG path, whose mask depends on the "
                f"TP size; tpinv.megatron cannot replace it: set its dropout to 0")
        for attr in ("self_attn_bda", "mlp_bda", "cross_attn_bda"):
            if _is_stock_bda(getattr(module, attr, None)) and getattr(module, "hidden_dropout", 0.0):
                raise NotImplementedError(
                    f"{name}.{attr} is megatron's RNG bias-dropout-add (hidden_dropout={module.hidden_dropout}), "
                    f"not TP-invariant: set hidden_dropout=0")
    _check_recompute_support(model)
    return count


def _check_recompute_support(model: torch.nn.Module) -> None:
    """Refuse dropout under megatron's recompute where megatron cannot say when it recomputes."""
    cfg = getattr(model, "config", None)
    if not getattr(cfg, "recompute_granularity", None):
        return
    if not (getattr(cfg, "hidden_dropout", 0.0) or getattr(cfg, "attention_dropout", 0.0)):
        return
    import megatron.core.tensor_parallel.random as mrandom
    if not hasattr(mrandom, "is_checkpointing"):
        raise NotImplementedError(
            f"recompute_granularity={cfg.recompute_granularity!r} with dropout needs megatron-core's "
            f"tensor_parallel.random.is_checkpointing (to replay a recomputed dropout's mask), which this "
            f"megatron-core lacks: set hidden_dropout=0 and attention_dropout=0, or turn recompute off")
