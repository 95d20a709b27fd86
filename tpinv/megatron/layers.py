"""tpinv's parallel linears as megatron-core builds them, for every supported megatron-core version.

Invariants kept, on top of :mod:`tpinv.layers.linear`'s:

* a ``tp_group`` of ``None`` (what megatron-core 0.12 passes from its attention and MLP) means
  megatron's own ``parallel_state`` tensor-parallel group -- megatron's convention, applied
  here explicitly before the tpinv layer sees the group;
* a gated MLP's ``linear_fc1`` (``[gate; up]``) is initialised with stride 2 at every version:
  each rank holds ``[gate_r; up_r]``, slices of one TP-independent gate and up weight
  (megatron-core 0.16 passes ``stride=2`` itself; earlier versions draw the fused weight as
  one block, a different function at each TP size);
* with ``skip_bias_add=True`` the column-parallel bias comes back broadcast to the output's
  shape through :class:`BroadcastBias`, whose backward sums the tokens in the fixed
  ``tree_sum(leaves=1)`` chain -- so megatron's own bias-add (bias-GeLU, bias-SwiGLU, plain
  add) gives the same bias gradient at every sharded width.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from tpinv.layers import ColumnParallelLinear, RowParallelLinear
from tpinv.ops import tree_sum


def megatron_tp_group(tp_group):
    """``tp_group``, or megatron's ``parallel_state`` TP group where megatron passed none."""
    if tp_group is not None:
        return tp_group
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron passed tp_group=None and megatron.core.parallel_state is not initialized: "
                           "call parallel_state.initialize_model_parallel(...) before building the model")
    return parallel_state.get_tensor_model_parallel_group()


class BroadcastBias(torch.autograd.Function):
    """``bias`` expanded to ``shape``; the gradient sums the leading dims in a fixed order."""

    @staticmethod
    def forward(ctx, bias, shape):
        ctx.dtype = bias.dtype
        return bias.expand(shape).contiguous()

    @staticmethod
    def backward(ctx, dy):
        return tree_sum(dy.reshape(-1, dy.shape[-1]).t(), 1).to(ctx.dtype), None


class MegatronColumnParallelLinear(ColumnParallelLinear):
    """:class:`tpinv.layers.ColumnParallelLinear` with megatron-core's group, gated-fc1 and bias conventions."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method, stride: int = 1,
                 tp_comm_buffer_name: Optional[str] = None, tp_group=None, **kwargs: Any):
        if stride == 1 and tp_comm_buffer_name == "fc1" and getattr(config, "gated_linear_unit", False):
            stride = 2
        super().__init__(input_size, output_size, config=config, init_method=init_method, stride=stride,
                         tp_comm_buffer_name=tp_comm_buffer_name, tp_group=megatron_tp_group(tp_group), **kwargs)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        y, bias = super().forward(input_, weight, runtime_gather_output)
        if bias is not None:
            if y.shape[-1] != bias.shape[-1]:
                raise NotImplementedError(f"{type(self).__name__}: skip_bias_add with a gathered output "
                                          "(gather_output=True) is not supported")
            bias = BroadcastBias.apply(bias, y.shape)
        return y, bias


class MegatronRowParallelLinear(RowParallelLinear):
    """:class:`tpinv.layers.RowParallelLinear` (tree strategy) with megatron-core's group convention."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method, tp_group=None,
                 **kwargs: Any):
        kwargs.setdefault("strategy", "tree")
        super().__init__(input_size, output_size, config=config, init_method=init_method,
                         tp_group=megatron_tp_group(tp_group), **kwargs)
