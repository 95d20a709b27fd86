"""TP-invariant ``ColumnParallelLinear`` and ``RowParallelLinear`` with megatron-core's signatures.

The output, the loss and every gradient have the same bits at every TP size dividing
the run's leaf count (see :mod:`tpinv.core.contract`).  Both return ``(output, output_bias)``.
Keywords tpinv does not support raise ``NotImplementedError`` naming the keyword.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from tpinv.core.autograd import PLAIN_TENSORS, apply_function, observed
from tpinv.core.contract import check_divisible, check_tp_size
from tpinv.distributed.groups import group_size_rank
from tpinv.layers.common import (
    check_layer_sizes, runs_only, config_leaves, config_row_strategy, init_sharded_weight,
    params_dtype, reject_unsupported,
)
from tpinv.layers.functions import (ColumnParallelGroupMatmul, ColumnParallelMatmul, RowParallelColumnOnlyMatmul,
                                    RowParallelTreeMatmul)
from tpinv.distributed.mappings import gather_from_tensor_model_parallel_region, scatter_to_tensor_model_parallel_region


def _device(config: Any) -> torch.device:
    if torch.cuda.is_available() and not getattr(config, "use_cpu_initialization", False):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reject_config(layer: str, config: Any) -> None:
    reject_unsupported(
        layer,
        gradient_accumulation_fusion=(bool(getattr(config, "gradient_accumulation_fusion", False)), False),
    )


def _seq_dim(config: Any) -> Optional[int]:
    """The sequence dim split by ``config.sequence_parallel`` (``config.tpinv_sequence_dim``:
    0 for Megatron's ``[s, b, h]``, 1 for tpinv's ``[b, s, h]``), or ``None`` when SP is off.

    The dim must be named: a megatron-core model with sequence parallelism is refused, as its
    norms' weight gradients are partial token sums added across ranks outside the contract."""
    if not getattr(config, "sequence_parallel", False):
        return None
    dim = getattr(config, "tpinv_sequence_dim", None)
    if dim is None:
        raise NotImplementedError(
            "sequence_parallel=True needs config.tpinv_sequence_dim (tpinv's Transformer sets it); "
            "megatron-core models with sequence_parallel are not supported (their norm weight gradients "
            "are per-rank token sums all-reduced out of the contract's order)")
    return int(dim)


def _mark(param: torch.nn.Parameter, dim: int, replicas: int = 1, replica_index: int = 0) -> None:
    """Megatron's tensor-parallel attributes, read by its optimizer and checkpoint code, and
    tpinv's replica count (``tpinv_replicas`` ranks hold the same shard; this is copy
    ``tpinv_replica_index``)."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    param.tpinv_replicas = replicas
    param.tpinv_replica_index = replica_index


def _make_bias(size: int, config: Any, device: torch.device) -> torch.nn.Parameter:
    b = torch.nn.Parameter(torch.zeros(size, dtype=params_dtype(config), device=device))
    return b


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split by rows (the output dim) across the TP group."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Optional[Callable],
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: Optional[list] = None,
        grad_output_buffer: Optional[list] = None,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        disable_grad_reduce: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
        leaves: Optional[int] = None,
        replicas: int = 1,
    ):
        super().__init__()
        name = type(self).__name__
        reject_unsupported(
            name, keep_master_weight_for_test=(keep_master_weight_for_test, False),
            embedding_activation_buffer=(embedding_activation_buffer, None),
            grad_output_buffer=(grad_output_buffer, None), is_expert=(is_expert, False),
        )
        _reject_config(name, config)
        self.config = config
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.disable_grad_reduce = disable_grad_reduce
        self.seq_dim = _seq_dim(config)
        if self.seq_dim is not None and disable_grad_reduce:
            raise NotImplementedError(f"{name}: sequence_parallel=True with disable_grad_reduce=True is not supported")
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size_rank(tp_group)
        self.leaves = config_leaves(config, leaves)
        if stride not in (1, 2, 4):
            raise NotImplementedError(f"{name}: stride={stride} is not supported (1, 2 or 4)")
        self.stride = stride
        check_tp_size(self.tp_size, self.leaves)   # named as given, before the strided sizes below
        check_layer_sizes(name, "output_size", output_size, self.tp_size * stride, self.leaves * stride)
        # replicas R (tpinv's KV-head replication): R consecutive ranks hold the same 1/(TP/R) of the rows
        if not isinstance(replicas, int) or replicas < 1 or self.tp_size % replicas or (replicas > 1 and stride != 1):
            raise NotImplementedError(f"{name}: replicas={replicas!r} must be a positive int dividing "
                                      f"TP={self.tp_size} (with stride=1)")
        self.replicas, self.replica_index = replicas, self.tp_rank % replicas
        shards, shard = self.tp_size // replicas, self.tp_rank // replicas
        self.output_size_per_partition = output_size // shards
        device = _device(config)
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = init_sharded_weight(
                (output_size, input_size), init_method, 0, shards, shard, params_dtype(config),
                device, getattr(config, "perform_initialization", True), stride)
            _mark(self.weight, 0, replicas, self.replica_index)
            self.weight.partition_stride = stride
        if bias:
            self.bias = _make_bias(self.output_size_per_partition, config, device)
            _mark(self.bias, 0, replicas, self.replica_index)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        if weight is None:
            if self.weight is None:
                raise RuntimeError(f"{type(self).__name__} was built with skip_weight_param_allocation=True: "
                                   "pass weight= to forward")
            weight = self.weight
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight has shape {tuple(weight.shape)}, expected {expected}")
        if input_.shape[-1] != self.input_size:
            raise ValueError(f"input has last dim {input_.shape[-1]}, expected {self.input_size}")
        bias = None if self.skip_bias_add else self.bias
        y = apply_function(ColumnParallelMatmul, input_, weight, bias, self.tp_group, self.leaves,
                           not self.disable_grad_reduce, self.stride, self.replicas,
                           self.replica_index, self.seq_dim)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.tp_size > 1:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)
        return y, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={self.tp_size}, leaves={self.leaves}"
                + (f", replicas={self.replicas}" if self.replicas > 1 else ""))


#: ColumnParallelLinear's own forward (a replaced one makes its layers take their own calls).
_COLUMN_FORWARD = ColumnParallelLinear.forward
_GROUPED = [0]


def grouped_calls() -> int:
    """How many :func:`column_parallel_group` calls so far ran as one node (tests assert it moves)."""
    return _GROUPED[0]


def _groupable(layers: tuple, x: torch.Tensor) -> bool:
    first = layers[0]
    for layer in layers:
        if (not runs_only(layer, ColumnParallelLinear, _COLUMN_FORWARD) or layer.weight is None
                or type(layer.weight) not in PLAIN_TENSORS
                or (layer.bias is not None and type(layer.bias) not in PLAIN_TENSORS)
                or (layer.gather_output and layer.tp_size > 1) or layer.tp_group is not first.tp_group
                or layer.seq_dim != first.seq_dim or layer.input_size != first.input_size):
            return False
    return type(x) in PLAIN_TENSORS and x.shape[-1] == first.input_size and not observed()


def column_parallel_group(layers, input_: torch.Tensor) -> tuple:
    """``tuple(layer(input_)[0] for layer in layers)`` for column-parallel layers of one input
    (q/k/v, gate/up): one autograd node instead of one per layer where nothing else could see
    the calls (plain layers running their own forward, no module hooks, not under torch.compile
    or a mode), else the layers' own calls.  The same bits either way
    (:class:`~tpinv.layers.functions.ColumnParallelGroupMatmul`); only the host time differs."""
    layers = tuple(layers)
    if not layers:
        raise ValueError("column_parallel_group needs at least one layer")
    if not _groupable(layers, input_):
        return tuple(layer(input_)[0] for layer in layers)
    for layer in layers:
        expected = (layer.output_size_per_partition, layer.input_size)
        if tuple(layer.weight.shape) != expected:
            raise ValueError(f"weight has shape {tuple(layer.weight.shape)}, expected {expected}")
    first = layers[0]
    settings = tuple((layer.leaves, not layer.disable_grad_reduce, layer.stride, layer.replicas,
                      layer.replica_index) for layer in layers)
    _GROUPED[0] += 1
    return apply_function(ColumnParallelGroupMatmul, input_, first.tp_group, first.seq_dim, settings,
                          *(layer.weight for layer in layers),
                          *(None if layer.skip_bias_add else layer.bias for layer in layers))


class RowParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split by columns (the input dim, ``tree``) or by rows
    (``column_only``) across the TP group; the same bits either way and at every TP size."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Optional[Callable],
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        leaves: Optional[int] = None,
        strategy: Optional[str] = None,
    ):
        super().__init__()
        name = type(self).__name__
        reject_unsupported(
            name, stride=(stride, 1), keep_master_weight_for_test=(keep_master_weight_for_test, False),
            is_expert=(is_expert, False),
        )
        _reject_config(name, config)
        self.config = config
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size_rank(tp_group)
        self.leaves = config_leaves(config, leaves)
        self.strategy = config_row_strategy(config, strategy)
        self.seq_dim = _seq_dim(config)
        if self.seq_dim is not None and (self.strategy != "tree" or bias or not input_is_parallel):
            raise NotImplementedError(f"{name}: sequence_parallel=True needs strategy='tree', bias=False and "
                                      f"input_is_parallel=True (got {self.strategy!r}, bias={bias}, "
                                      f"input_is_parallel={input_is_parallel})")
        self.input_size_per_partition = check_layer_sizes(name, "input_size", input_size, self.tp_size, self.leaves)
        device = _device(config)
        # tree: W[:, K_r] (Megatron's layout); column_only: W[N_r, :].
        dim = 1 if self.strategy == "tree" else 0
        if dim == 0:
            check_divisible(f"{name}.output_size", output_size, self.tp_size, "tensor-parallel size")
        self.weight = init_sharded_weight(
            (output_size, input_size), init_method, dim, self.tp_size, self.tp_rank, params_dtype(config),
            device, getattr(config, "perform_initialization", True))
        _mark(self.weight, dim)
        if bias:
            self.bias = _make_bias(output_size, config, device)
            self.bias.sequence_parallel = False
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        x = input_
        if not self.input_is_parallel and self.tp_size > 1:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        if x.shape[-1] != self.input_size_per_partition:
            raise ValueError(f"input has last dim {x.shape[-1]}, expected {self.input_size_per_partition} "
                             f"(input_size={self.input_size} / TP={self.tp_size}, input_is_parallel="
                             f"{self.input_is_parallel})")
        if self.strategy == "tree":
            y = apply_function(RowParallelTreeMatmul, x, self.weight, self.tp_group, self.leaves, self.seq_dim)
        else:
            y = apply_function(RowParallelColumnOnlyMatmul, x, self.weight, self.tp_group, self.leaves)
        if self.skip_bias_add:
            return y, self.bias
        return (y if self.bias is None else y + self.bias), None

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={self.tp_size}, leaves={self.leaves}, strategy={self.strategy}")
