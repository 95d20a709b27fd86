"""AdamW, warmup-cosine learning rate and gradient clipping with the same bits at every TP size.

* :class:`ParamLayout` lays the parameters of a (TP-sharded) model out in one flat fp32
  buffer -- master weights, main gradients and the AdamW moments all use it -- and knows
  each parameter's partition dim and full shape.
* :func:`global_grad_norm` follows the contract: per parameter, the squared gradient in the
  parameter's *canonical* order (partition dim first, flattened, which makes a rank's shard
  the contiguous ``1/C`` block of the full parameter) is reduced by the ``L``-leaf tree --
  each TP rank sums its ``L/C`` whole leaves, the tree reducer adds the ``C`` sub-trees;
  replicated parameters sum all ``L`` leaves locally.  The per-parameter values are then
  summed in name order by the fixed halving chain, and the square root taken.  The norm is
  therefore the same bits at every TP size, on every rank.
* :class:`InvariantAdamW` updates fp32 master weights with separate elementwise torch ops
  (``mul``, ``add``, ``sub``, ``div``, ``sqrt``) -- each one correctly rounded per element
  whatever the tensor's size, so the update of an element does not depend on how the
  parameter is sharded.  ``torch.optim.AdamW`` is not used on the invariant path: its kernels
  (``lerp``/``addcmul``, fused multiply-adds, per-device fused implementations) are free to
  round vector and tail elements differently; its fused CPU kernel gives different bits for a
  tensor updated whole and in 7-element pieces (tests/unit/test_training_units.py).
* :func:`lr_at` and :func:`clip_coefficient` are functions of their scalar arguments only.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

from tpinv.core.contract import DEFAULT_LEAVES, InvarianceError, check_leaves
from tpinv.kernels.reference_tree import halving_sum, leaf_tree_sum
from tpinv.distributed.groups import group_size
from tpinv.distributed.reduce import tree_all_reduce

__all__ = ["ParamSlot", "ParamLayout", "lr_at", "global_grad_norm", "vanilla_grad_norm", "clip_coefficient",
           "adamw_update", "InvariantAdamW", "TorchAdamW"]


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """The learning rate of 0-based step ``step``: linear warmup over ``warmup`` steps, then cosine to ``min_lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat buffers: ``[offset, offset + numel)``, viewed as ``shape``."""

    name: str
    offset: int
    numel: int
    shape: tuple
    full_shape: tuple
    partition_dim: Optional[int]
    decay: bool
    replicas: int = 1          # ranks holding this shard (replicated KV heads)
    replica_index: int = 0


class ParamLayout:
    """The model's parameters (in module order) packed into flat fp32 buffers."""

    def __init__(self, model: torch.nn.Module, tp_size: int = 1):
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        self.slots: list[ParamSlot] = []
        offset = 0
        for name, p in self.params.items():
            dim = int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None
            full = list(p.shape)
            reps = getattr(p, "tpinv_replicas", 1) if dim is not None else 1
            if dim is not None:
                full[dim] *= tp_size // reps
            self.slots.append(ParamSlot(name, offset, p.numel(), tuple(p.shape), tuple(full), dim, p.dim() >= 2,
                                        reps, getattr(p, "tpinv_replica_index", 0) if reps > 1 else 0))
            offset += p.numel()
        self.numel = offset
        self.by_name = {s.name: s for s in self.slots}

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        s = self.by_name[name]
        return flat[s.offset:s.offset + s.numel].view(s.shape)

    def flatten_params(self) -> torch.Tensor:
        """A new fp32 flat copy of the parameters' values (exact: bf16/fp16 -> fp32 widens)."""
        device = next(iter(self.params.values())).device if self.params else None
        flat = torch.empty(self.numel, dtype=torch.float32, device=device)
        for s in self.slots:
            self.view(flat, s.name).copy_(self.params[s.name].detach())
        return flat

    def flatten_grads(self, out: torch.Tensor) -> torch.Tensor:
        """Write each parameter's ``.grad`` (zeros when it has none) into ``out[:numel]``, widened to fp32."""
        for s in self.slots:
            g = self.params[s.name].grad
            view = self.view(out, s.name)
            view.zero_() if g is None else view.copy_(g)
        return out

    def copy_to_params(self, flat: torch.Tensor) -> None:
        """Round the fp32 ``flat`` values once to each parameter's dtype and store them."""
        with torch.no_grad():
            for s in self.slots:
                self.params[s.name].copy_(self.view(flat, s.name))

    def decay_ranges(self) -> list[tuple[int, int]]:
        """Merged ``[start, stop)`` ranges of the parameters that take weight decay (matrices)."""
        ranges: list[list[int]] = []
        for s in self.slots:
            if s.decay:
                if ranges and ranges[-1][1] == s.offset:
                    ranges[-1][1] += s.numel
                else:
                    ranges.append([s.offset, s.offset + s.numel])
        return [tuple(r) for r in ranges]


def _canonical_squares(grad: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    sq = grad * grad
    return (sq if dim is None else sq.movedim(dim, 0)).reshape(-1)


def global_grad_norm(grads: torch.Tensor, layout: ParamLayout, tp_group=None,
                     leaves: int = DEFAULT_LEAVES) -> torch.Tensor:
    """The L2 norm (fp32, 0-dim) of the full model gradient; the same bits at every TP size."""
    check_leaves(leaves)
    tp = group_size(tp_group)
    sharded, values = [], {}
    for s in layout.slots:
        full_numel = math.prod(s.full_shape)
        flat = _canonical_squares(layout.view(grads, s.name), s.partition_dim)
        if s.replicas > 1:  # a replicated shard: this rank's 1/R of it, the leaves it would own unreplicated
            flat = flat.view(s.replicas, -1)[s.replica_index]
        if s.partition_dim is not None and tp > 1:
            if full_numel % leaves:
                raise InvarianceError(f"{s.name}: {full_numel} elements (shape {s.full_shape}) do not split "
                                      f"into {leaves} leaves; a sharded parameter's size must be a multiple of "
                                      f"the leaf count for its gradient norm to be TP-invariant")
            sharded.append(s.name)
            values[s.name] = leaf_tree_sum(flat, leaves // tp)
        else:  # the whole parameter is here: all L leaves, zero-padded to a multiple of L
            pad = (-full_numel) % leaves
            if pad:
                flat = torch.nn.functional.pad(flat, (0, pad))
            values[s.name] = leaf_tree_sum(flat, leaves)
    if sharded:
        reduced = tree_all_reduce(torch.stack([values[n] for n in sharded]), tp_group, leaves=leaves)
        values.update(zip(sharded, reduced.unbind(0)))
    total = halving_sum(torch.stack([values[n] for n in sorted(values)]))
    return torch.sqrt(total)


def vanilla_grad_norm(grads: torch.Tensor, layout: ParamLayout, tp_group=None) -> torch.Tensor:
    """The norm the usual way (the control): ``torch.sum`` per shard, a plain all_reduce over TP."""
    sharded = torch.zeros((), dtype=torch.float32, device=grads.device)
    replicated = torch.zeros((), dtype=torch.float32, device=grads.device)
    for s in layout.slots:
        g = layout.view(grads, s.name)
        if s.partition_dim is not None:
            sharded = sharded + torch.sum(g * g)
        else:
            replicated = replicated + torch.sum(g * g)
    if group_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    return torch.sqrt(sharded + replicated)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> Optional[torch.Tensor]:
    """``max_norm / (norm + 1e-6)`` as a 0-dim fp32 tensor when it is below 1, else ``None`` (no clipping)."""
    if max_norm <= 0:
        return None
    coef = torch.tensor(max_norm, dtype=torch.float32, device=norm.device) / (norm + 1e-6)
    return coef if bool(coef < 1.0) else None


class InvariantAdamW:
    """AdamW (decoupled weight decay on matrices) on flat fp32 master weights, elementwise ops only."""

    kind = "tpinv-adamw"

    def __init__(self, layout: ParamLayout, *, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0):
        self.layout, self.betas, self.eps, self.weight_decay = layout, tuple(betas), eps, weight_decay
        self.master = layout.flatten_params()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = 0
        self._decay = layout.decay_ranges()

    @torch.no_grad()
    def step(self, grads: torch.Tensor, lr: float) -> None:
        """One update with the fp32 flat ``grads``; then the model parameters take the new values."""
        self.step_count += 1
        adamw_update(self.master, grads, self.exp_avg, self.exp_avg_sq, step=self.step_count, lr=lr,
                     betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, decay_ranges=self._decay)
        self.layout.copy_to_params(self.master)

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Views of ``name``'s master weight and moments (local shard shape)."""
        return {k: self.layout.view(getattr(self, k), name) for k in ("master", "exp_avg", "exp_avg_sq")}

    def state(self) -> dict:
        return {"kind": self.kind, "step": self.step_count, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay}

    def load_state(self, state: dict) -> None:
        self.step_count = int(state["step"])


def adamw_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int, lr: float,
                 betas, eps: float, weight_decay: float, decay_ranges=None) -> None:
    """In place: one AdamW step on fp32 tensors, each op elementwise and correctly rounded.

    ``decay_ranges`` (``[(start, stop)]`` of flat ``p``) limits weight decay; ``None`` decays all.
    No op takes an ``alpha``/``value`` multiplier, so none can fuse a multiply-add.
    """
    b1, b2 = betas
    m.mul_(b1).add_(g * (1.0 - b1))
    v.mul_(b2).add_((g * g) * (1.0 - b2))
    denom = (v / (1.0 - b2 ** step)).sqrt_().add_(eps)
    update = (m / (1.0 - b1 ** step)).div_(denom).mul_(lr)
    if weight_decay:
        keep = 1.0 - lr * weight_decay
        for start, stop in ([(0, p.numel())] if decay_ranges is None else decay_ranges):
            p[start:stop].mul_(keep)
    p.sub_(update)


class TorchAdamW:
    """The control: ``torch.optim.AdamW`` (the fused kernel) on per-parameter fp32 masters."""

    kind = "torch-adamw"

    def __init__(self, layout: ParamLayout, *, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0):
        self.layout = layout
        self.masters = {s.name: layout.params[s.name].detach().float().clone().requires_grad_(True)
                        for s in layout.slots}
        decay = [self.masters[s.name] for s in layout.slots if s.decay]
        rest = [self.masters[s.name] for s in layout.slots if not s.decay]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                            {"params": rest, "weight_decay": 0.0}], lr=0.0, betas=betas, eps=eps,
                                           fused=True)
        self.betas, self.eps, self.weight_decay, self.step_count = tuple(betas), eps, weight_decay, 0

    @torch.no_grad()
    def step(self, grads: torch.Tensor, lr: float) -> None:
        self.step_count += 1
        for s in self.layout.slots:
            self.masters[s.name].grad = self.layout.view(grads, s.name)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for s in self.layout.slots:
            self.layout.params[s.name].copy_(self.masters[s.name])

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        p = self.masters[name]
        st = self.optimizer.state.get(p)
        if not st:  # before the first step: zero moments
            st = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            self.optimizer.state[p] = dict(st, step=torch.tensor(0.0))
            st = self.optimizer.state[p]
        return {"master": p.data, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}

    def state(self) -> dict:
        return {"kind": self.kind, "step": self.step_count, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay}

    def load_state(self, state: dict) -> None:
        """Set the step count (after the moments were loaded through :meth:`tensors`)."""
        self.step_count = int(state["step"])
        for name in self.masters:
            self.tensors(name)
            self.optimizer.state[self.masters[name]]["step"] = torch.tensor(float(self.step_count))
