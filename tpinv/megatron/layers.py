"""tpinv's parallel linears as megatron-core builds them, for every supported megatron-core version.

Invariants kept, on top of :mod:`tpinv.layers.linear`'s:

* a ``tp_group`` of ``None`` (what megatron-core 0.12 passes from its attention and MLP) means
  megatron's own ``parallel_state`` tensor-parallel group -- megatron's convention, applied
  here explicitly before the tpinv layer sees the group;
* a gated MLP's ``linear_fc1`` (``[gate; up]``) is initialised with stride 2 at every version:
  each rank holds ``[gate_r; up_r]``, slices of one TP-independent gate and up weight
  (megatron-core 0.16 passes ``stride=2`` itself; earlier versions draw the fused weight as
  one block, a different function at each TP size);
* with ``skip_bias_add=True`` a column- or row-parallel bias comes back broadcast to the
  output's shape through :class:`BroadcastBias`, whose backward sums the tokens in the fixed
  ``tree_sum(leaves=1)`` chain -- so megatron's own bias-add (bias-GeLU, bias-SwiGLU,
  bias-dropout-add, plain add) gives the same bias gradient at every sharded width and thread
  count.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from tpinv.core.autograd import apply_function
from tpinv.core.contract import InvarianceError
from tpinv.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpinv.ops import tree_sum

#: The ``TransformerConfig`` attribute holding the leaf count (default ``tpinv.core.contract.DEFAULT_LEAVES``).
LEAVES_FIELD = "tpinv_leaves"


def _leaf_hint(err: InvarianceError, config) -> InvarianceError:
    now = getattr(config, LEAVES_FIELD, None)
    return InvarianceError(f"{err} -- the leaf count of a megatron-core model is the config field "
                           f"config.{LEAVES_FIELD} (now {now!r}); set it to a power of two dividing every "
                           f"reduced size, e.g. config.{LEAVES_FIELD} = 4 for hidden_size=12")


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


def token_sum(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x [..., h] -> [h]``: the tokens' rows summed in one fixed order (``tree_sum(leaves=1)``),
    the order of every token sum of a parameter's gradient in :mod:`tpinv.megatron`."""
    return tree_sum(x.reshape(-1, x.shape[-1]).t(), 1)


class BroadcastBias(torch.autograd.Function):
    """``bias`` expanded to ``shape``; the gradient sums the leading dims in a fixed order."""

    @staticmethod
    def forward(ctx, bias, shape):
        ctx.dtype = bias.dtype
        return bias.expand(shape).contiguous()

    @staticmethod
    def backward(ctx, dy):
        return token_sum(dy).to(ctx.dtype), None


class MegatronColumnParallelLinear(ColumnParallelLinear):
    """:class:`tpinv.layers.ColumnParallelLinear` with megatron-core's group, gated-fc1 and bias conventions."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method, stride: int = 1,
                 tp_comm_buffer_name: Optional[str] = None, tp_group=None, **kwargs: Any):
        if stride == 1 and tp_comm_buffer_name == "fc1" and getattr(config, "gated_linear_unit", False):
            stride = 2
        try:
            super().__init__(input_size, output_size, config=config, init_method=init_method, stride=stride,
                             tp_comm_buffer_name=tp_comm_buffer_name, tp_group=megatron_tp_group(tp_group), **kwargs)
        except InvarianceError as err:
            raise _leaf_hint(err, config) from None

    def forward(self, input_, weight=None, runtime_gather_output=None):
        y, bias = super().forward(input_, weight, runtime_gather_output)
        if bias is not None:
            if y.shape[-1] != bias.shape[-1]:
                raise NotImplementedError(f"{type(self).__name__}: skip_bias_add with a gathered output "
                                          "(gather_output=True) is not supported")
            bias = apply_function(BroadcastBias, bias, y.shape)
        return y, bias


class MegatronRowParallelLinear(RowParallelLinear):
    """:class:`tpinv.layers.RowParallelLinear` (tree strategy) with megatron-core's group convention."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method, tp_group=None,
                 **kwargs: Any):
        kwargs.setdefault("strategy", "tree")
        try:
            super().__init__(input_size, output_size, config=config, init_method=init_method,
                             tp_group=megatron_tp_group(tp_group), **kwargs)
        except InvarianceError as err:
            raise _leaf_hint(err, config) from None

    def forward(self, input_):
        y, bias = super().forward(input_)
        if bias is not None:   # megatron adds it (bias-dropout-add): its gradient, the fixed token sum
            bias = apply_function(BroadcastBias, bias, y.shape)
        return y, bias


def _sharded_state_dict(layer, prefix, axis_map, sharded_offsets, metadata):
    """megatron's ``make_sharded_tensors_for_checkpoint`` for a tpinv layer, with the keywords the
    installed version takes: the full tensors are the same at every TP size, so a checkpoint saved
    at one TP size loads at another."""
    import inspect

    from megatron.core import parallel_state
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state = layer.state_dict(prefix="", keep_vars=True)
    kwargs = {}
    if "tp_group" in inspect.signature(make_sharded_tensors_for_checkpoint).parameters:
        kwargs["tp_group"] = layer.tp_group if layer.tp_group is not None else \
            parallel_state.get_tensor_model_parallel_group()
        kwargs["dp_cp_group"] = (metadata or {}).get("dp_cp_group") or \
            parallel_state.get_data_parallel_group(with_context_parallel=True)
    return make_sharded_tensors_for_checkpoint(state, prefix, axis_map, sharded_offsets, **kwargs)


def _column_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    return _sharded_state_dict(self, prefix, {"weight": 0, "bias": 0}, sharded_offsets, metadata)


def _row_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    return _sharded_state_dict(self, prefix, {"weight": 1}, sharded_offsets, metadata)


MegatronColumnParallelLinear.sharded_state_dict = _column_sharded_state_dict
MegatronRowParallelLinear.sharded_state_dict = _row_sharded_state_dict


class MegatronVocabParallelEmbedding(VocabParallelEmbedding):
    """:class:`tpinv.layers.VocabParallelEmbedding` with megatron's group convention and checkpoint hook."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, config: Any, init_method=None, tp_group=None,
                 **kwargs: Any):
        try:
            super().__init__(num_embeddings, embedding_dim, init_method=init_method, config=config,
                             tp_group=megatron_tp_group(tp_group), **kwargs)
        except InvarianceError as err:
            raise _leaf_hint(err, config) from None

    sharded_state_dict = _column_sharded_state_dict
