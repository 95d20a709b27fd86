"""An invariant gradient norm and clipping for megatron-core's optimizers.

Invariant kept: the norm megatron's optimizer clips with is the same bits at every TP size and
equals :func:`tpinv.training.optim.global_grad_norm` for the same gradients -- per parameter,
the squared gradient in canonical order (partition dim first) reduced by the ``L``-leaf tree
(the tree reducer adds the TP ranks' sub-trees), then the per-parameter values summed in name
order by the fixed halving chain.  Pipeline stages exchange their per-parameter values (names
carry the global layer number, so a stage's names are the PP=1 model's names) and every rank
sums all of them.  Clipping multiplies each gradient by ``max_norm / (norm + 1e-6)`` when
that is below 1, as megatron does: elementwise, so sharding cannot change it.

:func:`use_invariant_grad_norm` installs this on an optimizer returned by
``get_megatron_optimizer`` (plain, distributed, chained).
"""
from __future__ import annotations

import re
import types
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from tpinv.core.contract import DEFAULT_LEAVES, InvarianceError, check_leaves
from tpinv.distributed.reduce import tree_all_reduce
from tpinv.kernels.reference_tree import halving_sum, leaf_tree_sum


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def global_parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(param) -> name`` with each transformer layer's index replaced by its global layer number - 1."""
    model = _unwrap(model)
    layer_of = {}
    for name, module in model.named_modules():
        number = getattr(module, "layer_number", None)
        if re.fullmatch(r"(.*\.)?layers\.\d+", name) and number is not None:
            layer_of[name] = int(number) - 1
    names = {}
    for name, p in model.named_parameters():
        for prefix, number in layer_of.items():
            if name.startswith(prefix + "."):
                name = re.sub(r"layers\.\d+$", f"layers.{number}", prefix) + name[len(prefix):]
                break
        names[id(p)] = name
    return names


def _grad(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    g = getattr(p, "main_grad", None)
    return p.grad if g is None else g


def invariant_grad_norm(model_chunks: Sequence[torch.nn.Module], *, tp_group, pp_group=None,
                        leaves: int = DEFAULT_LEAVES) -> torch.Tensor:
    """The L2 norm (fp32, 0-dim) of the model's gradients (``main_grad`` where megatron DDP keeps one)."""
    check_leaves(leaves)
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    values, sharded = {}, []
    for chunk in model_chunks:
        names = global_parameter_names(chunk)
        for p in _unwrap(chunk).parameters():
            g = _grad(p)
            if g is None or getattr(p, "shared", False):  # megatron's param_is_not_shared
                continue
            dim = int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None
            sq = g.float() * g.float()
            flat = (sq if dim is None else sq.movedim(dim, 0)).reshape(-1)
            name = names[id(p)]
            if dim is not None and tp > 1:
                if (flat.numel() * tp) % leaves:
                    raise InvarianceError(f"{name}: {flat.numel() * tp} elements do not split into leaves={leaves}; "
                                          f"set config.tpinv_leaves to a divisor of every sharded size")
                sharded.append(name)
                values[name] = leaf_tree_sum(flat, leaves // tp)
            else:
                pad = (-flat.numel()) % leaves
                values[name] = leaf_tree_sum(torch.nn.functional.pad(flat, (0, pad)) if pad else flat, leaves)
    if sharded:
        reduced = tree_all_reduce(torch.stack([values[n] for n in sharded]), tp_group, leaves=leaves)
        values.update(zip(sharded, reduced.unbind(0)))
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        every = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(every, {n: v.item() for n, v in values.items()}, group=pp_group)
        device = next(iter(values.values())).device if values else None
        values = {n: torch.tensor(v, dtype=torch.float32, device=device) for part in every for n, v in part.items()}
    if not values:
        return torch.zeros((), dtype=torch.float32)
    return torch.sqrt(halving_sum(torch.stack([values[n] for n in sorted(values)])))


def _optimizer_grads(optimizer) -> list[torch.Tensor]:
    grads = []
    for p in optimizer.get_parameters():
        g = getattr(p, "decoupled_grad", None) if getattr(optimizer.config, "use_precision_aware_optimizer", False) \
            else p.grad
        if g is not None:
            grads.append(g)
    return grads


def use_invariant_grad_norm(optimizer, model_chunks: Sequence[torch.nn.Module], *, tp_group, pp_group=None,
                            leaves: Optional[int] = None):
    """Make ``optimizer`` (from ``get_megatron_optimizer``) compute its grad norm with
    :func:`invariant_grad_norm` and clip elementwise; returns ``optimizer``.

    Refuses fp16 loss scaling (the norm is taken from the model's unscaled ``main_grad``) and a
    distributed optimizer over several data-parallel ranks (each keeps only its shard of the grads).
    """
    from tpinv.megatron.version import megatron_version

    megatron_version()
    if leaves is None:
        leaves = getattr(getattr(optimizer, "config", None), "tpinv_leaves", None) or \
            getattr(getattr(_unwrap(model_chunks[0]), "config", None), "tpinv_leaves", None) or DEFAULT_LEAVES
    inner = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    for opt in inner:
        if getattr(opt.config, "fp16", False):
            raise NotImplementedError("use_invariant_grad_norm: fp16 loss scaling is not supported (use bf16 or fp32)")
        if getattr(opt.config, "use_distributed_optimizer", False):
            dp = opt.data_parallel_group if hasattr(opt, "data_parallel_group") else None
            if dp is not None and dist.get_world_size(dp) > 1:
                raise NotImplementedError("use_invariant_grad_norm: the distributed optimizer over "
                                          f"{dist.get_world_size(dp)} data-parallel ranks is not supported (DP=1 only)")

    def grad_norm(self=None):
        return invariant_grad_norm(model_chunks, tp_group=tp_group, pp_group=pp_group, leaves=leaves).item()

    def clip(self, clip_grad: float) -> float:
        norm = grad_norm()
        coeff = clip_grad / (norm + 1.0e-6)
        if coeff < 1.0:
            for opt in inner:
                for g in _optimizer_grads(opt):
                    g.mul_(coeff)
        return norm

    for opt in inner + ([optimizer] if optimizer not in inner else []):
        opt.get_grad_norm = types.MethodType(grad_norm, opt)
        opt.clip_grad_norm = types.MethodType(clip, opt)
    optimizer._tpinv_invariant_grad_norm = True
    return optimizer
