"""Shared pieces of the parallel layers: keyword checks, the leaf count, sharded init.

Sharded initialization keeps one invariant: for the same RNG state, every TP size
holds slices of the *same* full weight.  The full master weight is drawn on the CPU
(consuming the RNG identically at every TP size) and each rank keeps its slice.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from tpinv.core.contract import DEFAULT_LEAVES, check_divisible, check_leaves, check_tp_size

ROW_STRATEGIES = ("tree", "column_only")


def reject_unsupported(layer: str, **given: tuple[Any, Any]) -> None:
    """Raise NotImplementedError for each keyword whose value differs from the supported one.

    ``given`` maps keyword -> (value, supported value).
    """
    for name, (value, supported) in given.items():
        if value is supported or value == supported:
            continue
        raise NotImplementedError(
            f"{layer}: {name}={value!r} is not supported by tpinv (only {name}={supported!r}); "
            f"remove the keyword or use megatron-core's own layer for this module")


def config_leaves(config: Any, leaves: Optional[int]) -> int:
    """The run's leaf count: the explicit argument, else ``config.tpinv_leaves``, else TP_MAX."""
    if leaves is None:
        leaves = getattr(config, "tpinv_leaves", None) or DEFAULT_LEAVES
    return check_leaves(int(leaves))


def config_row_strategy(config: Any, strategy: Optional[str]) -> str:
    if strategy is None:
        strategy = getattr(config, "tpinv_row_strategy", None) or "tree"
    if strategy not in ROW_STRATEGIES:
        raise ValueError(f"row strategy {strategy!r} is not one of {ROW_STRATEGIES}")
    return strategy


def check_layer_sizes(layer: str, size_name: str, size: int, tp: int, leaves: int) -> int:
    """A dimension reduced by the leaf tree must split into ``leaves`` leaves and ``tp`` shards."""
    check_tp_size(tp, leaves)
    check_divisible(f"{layer}.{size_name}", size, leaves, "leaves")
    return check_divisible(f"{layer}.{size_name}", size, tp, "tensor-parallel size")


def params_dtype(config: Any) -> torch.dtype:
    return getattr(config, "params_dtype", None) or torch.float32


def init_sharded_weight(
    shape: tuple[int, int],
    init_method: Optional[Callable[[torch.Tensor], Any]],
    dim: int,
    tp: int,
    rank: int,
    dtype: torch.dtype,
    device: Optional[torch.device] = None,
    perform_initialization: bool = True,
    stride: int = 1,
) -> torch.nn.Parameter:
    """Draw the full ``shape`` master weight in fp32 on the CPU, keep slice ``rank`` of ``tp`` along ``dim``.

    With ``stride`` s the dimension is s equal blocks and the rank keeps its slice of each
    (Megatron's layout for a fused ``[gate; up]`` weight).
    """
    part = shape[dim] // tp
    if not perform_initialization or init_method is None:
        local = list(shape)
        local[dim] = part
        return torch.nn.Parameter(torch.empty(local, dtype=dtype, device=device))
    master = torch.empty(shape, dtype=torch.float32)
    init_method(master)
    local = torch.cat(master.split(part // stride, dim=dim)[rank::tp], dim=dim).to(dtype=dtype)
    return torch.nn.Parameter(local.to(device) if device is not None else local)


def runs_only(module: torch.nn.Module, cls: type, forward) -> bool:
    """Whether calling ``module`` runs exactly ``forward`` (``cls``'s own, as defined): ``module`` is a
    ``cls`` and no subclass, its ``forward`` is replaced neither on it nor on the class, and no hook
    on it or global module hook runs.  Grouped calls of layers are taken only then."""
    return (type(module) is cls and cls.forward is forward and "forward" not in module.__dict__
            and not has_hooks(module))


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs a hook: one on it, or a global module hook."""
    nn_module = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None)
                or any(getattr(nn_module, name, None) for name in (
                    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                    "_global_backward_pre_hooks")))
