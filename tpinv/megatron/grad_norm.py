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
``get_megatron_optimizer`` (plain, distributed, chained; fp32 or bf16 parameters).  Under the
distributed optimizer over several data-parallel ranks the reduced gradient shards are
all-gathered first, so every rank takes the norm of the whole gradient.
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


def _distributed_optimizer_groups(model_chunks) -> list:
    """megatron DDP bucket groups whose gradients the distributed optimizer reduce-scatters over
    several data-parallel ranks (each rank then holds only its shard of the reduced gradient)."""
    groups = []
    for chunk in model_chunks:
        for bucket_group in list(getattr(chunk, "bucket_groups", [])) + list(
                getattr(chunk, "expert_parallel_bucket_groups", [])):
            ddp_config = bucket_group.ddp_config
            if not ddp_config.use_distributed_optimizer:
                continue
            if getattr(ddp_config, "num_distributed_optimizer_instances", 1) > 1:
                raise NotImplementedError("use_invariant_grad_norm: num_distributed_optimizer_instances > 1 "
                                          "is not supported")
            group = getattr(bucket_group, "intra_distributed_optimizer_instance_group", None) or \
                bucket_group.data_parallel_group
            if dist.get_world_size(group) > 1:
                groups.append((bucket_group, group))
    return groups


def gather_reduced_grads(model_chunks) -> None:
    """Where megatron's distributed optimizer left each data-parallel rank only its shard of the
    reduced gradient, all-gather the shards into every rank's ``main_grad`` buffers (megatron's
    layout: each bucket's ``grad_data`` cut into equal contiguous shards in rank order), so the
    norm reads the whole reduced gradient.  The optimizer reads only its own shard, unchanged."""
    for bucket_group, group in _distributed_optimizer_groups(model_chunks):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        for bucket in bucket_group.buckets:
            flat = bucket.grad_data.view(-1)
            if flat.numel() % size:
                raise RuntimeError(f"a megatron gradient bucket of {flat.numel()} elements is not padded to a "
                                   f"multiple of the {size} data-parallel ranks")
            shard = flat.numel() // size
            dist.all_gather_into_tensor(flat, flat[rank * shard:(rank + 1) * shard].clone(), group=group)


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

    With megatron's distributed optimizer over several data-parallel ranks (``model_chunks``: the
    ``DistributedDataParallel`` modules), the reduced gradient shards are first all-gathered into
    every rank's ``main_grad`` (:func:`gather_reduced_grads`: one all-gather of the gradients).
    Refuses fp16 loss scaling (the norm is taken from the model's unscaled ``main_grad``).
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
        if getattr(opt.config, "use_distributed_optimizer", False) and \
                not all(hasattr(chunk, "bucket_groups") for chunk in model_chunks):
            raise NotImplementedError("use_invariant_grad_norm: with the distributed optimizer, pass megatron's "
                                      "DistributedDataParallel modules as model_chunks (their gradient buffers "
                                      "hold the reduced shards)")
    _distributed_optimizer_groups(model_chunks)  # refuses what it cannot gather, now

    def grad_norm(self=None):
        gather_reduced_grads(model_chunks)
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
