"""DTensor ``ParallelStyle`` classes that keep the invariance contract, forward and backward.

``parallelize_module`` applies each on a 1-D mesh.  The sharding styles turn the module's
parameters into DTensors and replace the instance's ``forward`` by one that runs tpinv's
autograd functions (:mod:`tpinv.layers.functions`) on the local shards, so every cross-rank
sum is a tree reduction of fp32 partials:

* :class:`InvariantColwiseParallel` (q/k/v, gate/up, lm_head): weight ``Shard(0)``; ``dX``, a
  sum over the split N, is each rank's sub-tree over its ``L/C`` N-leaves, tree-reduced.
* :class:`InvariantColumnOnlyParallel` (o_proj/down_proj): input ``Shard(-1)``, weight
  ``Shard(0)``, output ``Replicate``: all-gather x, the N-slice of the full ``L``-leaf tree
  over K, all-gather y; ``dX`` is a tree reduce-scatter.
* :class:`InvariantVocabEmbedding`: rows ``Shard(0)``, exact lookup, token-order gradient.
* KV-head replication (TP = R x KV heads): k/v projections take ``InvariantColwiseParallel``
  with a ``replica_mesh`` -- the TP mesh unflattened to ``(kv, replica)`` -- and placements
  ``(Shard(0), Replicate())``: each KV head's rows are held by the R ranks of its replica group
  (Megatron's layout), and every replica computes the same whole gradient of them
  (:mod:`tpinv.layers.kv_replication`), so the replicated gradient needs no reduction.

:class:`ShardedHeads` sets local head counts; :class:`TpinvModelGroup` hands the mesh's
group to a ``tpinv.models.Transformer``; :mod:`tpinv.dtensor.hf_modules` swaps HF's own norm, RoPE,
SiLU and attention for tpinv's.  Parameters no style shards (norm weights) stay plain
replicated tensors.
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from tpinv.core.autograd import apply_function
from tpinv.core.contract import DEFAULT_LEAVES, InvarianceError, check_divisible, check_tp_size
from tpinv.layers.embedding import _VocabParallelLookup
from tpinv.layers.functions import ColumnParallelMatmul, RowParallelColumnOnlyMatmul
from tpinv.distributed.mappings import gather_from_tensor_model_parallel_region
from tpinv.ops import tree_sum

__all__ = ["MeshInfo", "InvariantColwiseParallel", "InvariantColumnOnlyParallel",
           "InvariantVocabEmbedding", "ShardedHeads", "TpinvModelGroup", "local",
           "mesh_info", "replace_forward", "replica_mesh"]

OUTPUTS = ("shard", "replicate", "dtensor")

#: torch < 2.7: ``distribute_tensor`` has no ``src_data_rank`` and always sends the mesh's first
#: rank's data, which is ``src_data_rank=0``; any other choice is refused there.
_HAS_SRC_DATA_RANK = "src_data_rank" in inspect.signature(distribute_tensor).parameters


@dataclass(frozen=True)
class MeshInfo:
    """The mesh, its group, size, this rank and the leaf count of a replaced forward."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    size: int
    rank: int
    leaves: int


def mesh_info(mesh: DeviceMesh, leaves: int) -> MeshInfo:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"expected a 1-D DeviceMesh (the TP mesh, e.g. mesh['tp']), got {mesh!r}")
    size = mesh.size()
    check_tp_size(size, leaves)
    return MeshInfo(mesh, mesh.get_group(), size, mesh.get_local_rank(), leaves)


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The local shard of a DTensor (differentiable), a plain tensor unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t


def replace_forward(module: nn.Module, fn: Callable) -> None:
    """Bind ``fn(module, ...)`` as this instance's ``forward`` (the class is untouched)."""
    module.forward = types.MethodType(fn, module)


def _input(x, module: nn.Module, want: str) -> torch.Tensor:
    """A plain local input; a DTensor input must already have the layout ``want``."""
    if isinstance(x, DTensor):
        placement = x.placements[0]
        ok = placement.is_replicate() if want == "replicate" else (
            placement.is_shard() and placement.dim % x.ndim == x.ndim - 1)
        if not ok:
            raise InvarianceError(f"{type(module).__name__} expects a {want} input, got a DTensor "
                                  f"with placements {x.placements}")
        return x.to_local()
    return x


def _shard_param(module: nn.Module, name: str, mesh: DeviceMesh, placement, src_data_rank) -> None:
    param = getattr(module, name, None)
    if param is None:
        return
    if isinstance(param, DTensor):
        raise InvarianceError(f"{type(module).__name__}.{name} is already a DTensor: the module was "
                              f"parallelized before; apply a plan to an unsharded model once")
    if not _HAS_SRC_DATA_RANK and src_data_rank != 0:
        raise NotImplementedError(f"src_data_rank={src_data_rank!r} needs torch >= 2.7 (this torch "
                                  f"{torch.__version__} always distributes rank 0's data)")
    kwargs = {"src_data_rank": src_data_rank} if _HAS_SRC_DATA_RANK else {}
    placements = list(placement) if isinstance(placement, tuple) else [placement]
    dist_param = nn.Parameter(distribute_tensor(param.detach(), mesh, placements, **kwargs),
                              requires_grad=param.requires_grad)
    module.register_parameter(name, dist_param)


def _weight_2d(module: nn.Module) -> tuple[int, int]:
    w = getattr(module, "weight", None)
    if w is None and hasattr(module, "output_size"):  # tpinv's tied lm_head: weight= at call time
        return module.output_size, module.input_size
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TypeError(f"{type(module).__name__} has no 2-D weight [out_features, in_features]: "
                        f"expected nn.Linear or a tpinv parallel linear")
    if getattr(module, "skip_bias_add", False):
        raise NotImplementedError(f"{type(module).__name__}: skip_bias_add=True is not supported")
    return tuple(w.shape)


class _AddReplicatedBias(torch.autograd.Function):
    """``y + b``; ``db`` sums the tokens in a fixed order (``tree_sum(., 1)``)."""

    @staticmethod
    def forward(ctx, y, bias):
        ctx.dtype = bias.dtype
        return y + bias

    @staticmethod
    def backward(ctx, dy):
        return dy, tree_sum(dy.reshape(-1, dy.shape[-1]).t(), 1).to(ctx.dtype)


class _InvariantStyle(ParallelStyle):
    src_data_rank: Optional[int] = 0   # torch >= 2.7's ParallelStyle default; parallelize_module sets it

    def __init__(self, *, leaves: int = DEFAULT_LEAVES):
        super().__init__()
        self.leaves = leaves

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "src_data_rank")
        return f"{type(self).__name__}({fields})"


class InvariantColwiseParallel(_InvariantStyle):
    """Column-parallel linear (q/k/v, gate/up, lm_head): weight and bias ``Shard(0)``.

    ``output``: ``"shard"`` -- this rank's ``[..., N/C]`` slice as a plain tensor;
    ``"replicate"`` -- the whole ``[..., N]``, gathered exactly (backward: the rank's slice);
    ``"dtensor"`` -- the slice as a ``Shard(-1)`` DTensor (for a vocab-parallel loss).

    ``replica_mesh`` (k/v projections with TP above the KV heads): the TP mesh as a 2-D
    ``(kv, replica)`` mesh (:func:`replica_mesh`); weight and bias ``(Shard(0), Replicate())``.
    """

    def __init__(self, *, output: str = "shard", leaves: int = DEFAULT_LEAVES,
                 replica_mesh: Optional[DeviceMesh] = None):
        super().__init__(leaves=leaves)
        if output not in OUTPUTS:
            raise ValueError(f"output={output!r}: expected one of {OUTPUTS}")
        if replica_mesh is not None and (replica_mesh.ndim != 2 or output != "shard"):
            raise ValueError(f"replica_mesh must be a 2-D (kv, replica) mesh with output='shard', got "
                             f"{replica_mesh!r}, output={output!r}")
        self.output, self.replica_mesh = output, replica_mesh

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        info = mesh_info(device_mesh, self.leaves)
        out_features, _ = _weight_2d(module)
        check_divisible(f"{type(module).__name__} out_features", out_features, self.leaves)
        replicas, replica_index = 1, 0
        if self.replica_mesh is None:
            for name in ("weight", "bias"):
                _shard_param(module, name, device_mesh, Shard(0), self.src_data_rank)
        else:
            if self.replica_mesh.size() != info.size:
                raise InvarianceError(f"replica_mesh {self.replica_mesh!r} does not cover the TP mesh of "
                                      f"{info.size} ranks")
            replicas, replica_index = self.replica_mesh.size(1), self.replica_mesh.get_local_rank(1)
            for name in ("weight", "bias"):
                _shard_param(module, name, self.replica_mesh, (Shard(0), Replicate()), self.src_data_rank)
        output, as_tuple = self.output, not isinstance(module, nn.Linear)  # tpinv's linears: (y, bias)

        def forward(mod, x, weight=None, runtime_gather_output=None):
            w = local(mod.weight if weight is None else weight)
            if w is None:
                raise RuntimeError(f"{type(mod).__name__} holds no weight: pass weight=")
            x = _input(x, mod, "replicate")
            if x.shape[-1] != w.shape[1]:
                raise ValueError(f"{type(mod).__name__}: input of shape {tuple(x.shape)}, expected "
                                 f"[..., {w.shape[1]}]")
            y = apply_function(ColumnParallelMatmul, x, w, local(mod.bias), info.group, info.leaves, True, 1,
                               replicas, replica_index)
            if output == "replicate":
                y = gather_from_tensor_model_parallel_region(y, info.group)
            elif output == "dtensor":
                y = DTensor.from_local(y, info.mesh, [Shard(y.dim() - 1)], run_check=False)
            return (y, None) if as_tuple else y

        replace_forward(module, forward)
        return module


class InvariantColumnOnlyParallel(_InvariantStyle):
    """``o_proj`` / ``down_proj`` in the column-only layout: input ``Shard(-1)``, weight
    ``Shard(0)`` (rows = output features), output ``Replicate``; bias replicated.

    The same bits as a row-parallel tree layer and as TP=1 (:class:`RowParallelColumnOnlyMatmul`).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        info = mesh_info(device_mesh, self.leaves)
        out_features, in_features = _weight_2d(module)
        check_divisible(f"{type(module).__name__} out_features", out_features, self.leaves)
        check_divisible(f"{type(module).__name__} in_features", in_features, self.leaves)
        _shard_param(module, "weight", device_mesh, Shard(0), self.src_data_rank)
        _shard_param(module, "bias", device_mesh, Replicate(), self.src_data_rank)
        as_tuple, k_local = not isinstance(module, nn.Linear), in_features // info.size

        def forward(mod, x):
            x = _input(x, mod, "shard")
            if x.shape[-1] != k_local:
                raise ValueError(f"{type(mod).__name__}: local input of shape {tuple(x.shape)}, "
                                 f"expected [..., {k_local}] (in_features / TP)")
            y = apply_function(RowParallelColumnOnlyMatmul, x, local(mod.weight), info.group, info.leaves)
            if mod.bias is not None:
                y = apply_function(_AddReplicatedBias, y, local(mod.bias))
            return (y, None) if as_tuple else y

        replace_forward(module, forward)
        return module


class InvariantVocabEmbedding(_InvariantStyle):
    """Token embedding with the table split by rows (the vocabulary), output replicated.

    Each rank looks up its rows (zeros elsewhere); the tree reducer adds the shards, one of
    which is non-zero, so the sum is exact.  A row's gradient is its tokens' gradients in
    token order.  HF's ``padding_idx`` row gets no gradient, as in ``nn.Embedding``.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        info = mesh_info(device_mesh, self.leaves)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"{type(module).__name__} has no 2-D weight [num_embeddings, dim]")
        check_divisible(f"{type(module).__name__} num_embeddings", weight.shape[0], self.leaves)
        if getattr(module, "max_norm", None) is not None or getattr(module, "sparse", False):
            raise NotImplementedError("embeddings with max_norm or sparse gradients are not supported")
        _shard_param(module, "weight", device_mesh, Shard(0), self.src_data_rank)
        vocab = weight.shape[0]

        def forward(mod, ids):
            if ids.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"token ids must be int64 or int32, got {ids.dtype}")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise IndexError(f"token ids must lie in [0, {vocab}), got min {int(ids.min())} "
                                 f"and max {int(ids.max())}")
            w = local(mod.weight)
            out = apply_function(_VocabParallelLookup, ids.long(), w, info.rank * w.shape[0], info.group, info.leaves)
            pad = getattr(mod, "padding_idx", None)
            if pad is not None:
                out = torch.where((ids == pad).unsqueeze(-1), out.detach(), out)
            return out

        replace_forward(module, forward)
        return module


_REPLICA_MESHES: dict = {}


def replica_mesh(tp_mesh: DeviceMesh, num_kv_heads: int) -> DeviceMesh:
    """The 1-D TP mesh as a 2-D ``(kv, replica)`` mesh: ``R = TP / num_kv_heads`` consecutive
    ranks per KV head (the layout of :mod:`tpinv.layers.kv_replication`; the caller checked
    ``R`` with :func:`tpinv.models.kv_replicas`).  Built once per mesh (it creates the replica
    process groups); the TP mesh must have a dimension name."""
    size = tp_mesh.size()
    replicas = size // num_kv_heads
    key = (tp_mesh, num_kv_heads)
    if key not in _REPLICA_MESHES:
        names = tp_mesh.mesh_dim_names
        if not names:
            raise InvarianceError(f"TP={size} exceeds num_kv_heads={num_kv_heads}: replicating KV heads "
                                  f"needs a named TP mesh (init_device_mesh(..., mesh_dim_names=('tp',)) or "
                                  f"mesh['tp']), got {tp_mesh!r}")
        if not hasattr(tp_mesh, "_unflatten"):
            raise InvarianceError(f"TP={size} exceeds num_kv_heads={num_kv_heads}: replicating KV heads in the "
                                  f"DTensor plan needs DeviceMesh._unflatten, which torch {torch.__version__} lacks; "
                                  f"use TP <= {num_kv_heads} or a newer torch")
        _REPLICA_MESHES[key] = tp_mesh._unflatten(0, (num_kv_heads, replicas),
                                                  (f"{names[0]}_kv", f"{names[0]}_kv_replica"))
    return _REPLICA_MESHES[key]


class ShardedHeads(ParallelStyle):
    """Set the local head counts on an attention module (its config stays untouched).

    Sets ``num_heads`` and ``num_key_value_heads`` to ``total // TP`` and updates any of the
    other names attention modules use (``num_attention_heads``, ``num_kv_heads``,
    ``local_heads``, ``local_kv_heads``); the ``view`` shapes of a forward that reads them
    then match the sharded projections.  With TP above the KV heads each rank keeps one KV
    head, held by ``replicas = TP / num_kv_heads`` ranks (set as ``replicas``, with the TP
    group as ``tp_group``, on a module that has them).  A tpinv Qwen3 q/k norm gets the mesh's
    group (and the k norm the replica count) for its cross-head weight gradient.
    """

    HEADS = ("num_heads", "num_attention_heads", "local_heads")
    KV_HEADS = ("num_key_value_heads", "num_kv_heads", "local_kv_heads")

    def __init__(self, num_heads: int, num_kv_heads: int, replicas: int = 1):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.replicas = num_heads, num_kv_heads, replicas

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        size, replicas = device_mesh.size(), self.replicas
        for name, total in (("num_heads", self.num_heads), ("num_key_value_heads * replicas",
                                                            self.num_kv_heads * replicas)):
            if total % size:
                raise InvarianceError(f"{name}={total} is not divisible by TP={size}")
        if replicas > 1 and self.num_kv_heads * replicas != size:
            raise InvarianceError(f"replicas={replicas}: expected TP / num_key_value_heads = {size} / "
                                  f"{self.num_kv_heads}")
        heads, kv_heads = self.num_heads // size, self.num_kv_heads * replicas // size
        module.num_heads, module.num_key_value_heads = heads, kv_heads
        for names, value in ((self.HEADS, heads), (self.KV_HEADS, kv_heads)):
            for name in names:
                if hasattr(module, name):
                    setattr(module, name, value)
        group = device_mesh.get_group()
        if hasattr(module, "replicas"):  # tpinv's Attention: its query-head gathers
            module.replicas, module.tp_group = replicas, group
        for norm, norm_replicas in ((getattr(module, "q_norm", None), 1),
                                    (getattr(module, "k_norm", None), replicas)):
            if norm is not None and hasattr(norm, "group"):  # tpinv's HeadRMSNorm
                norm.group, norm.replicas = group, norm_replicas
        return module

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"replicas={self.replicas})")


class TpinvModelGroup(ParallelStyle):
    """Give a ``tpinv.models.Transformer`` the mesh's group: its logits gather, loss and KV
    cache then follow the sharded layers."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.tp_group = device_mesh.get_group()
        module.tp_size, module.tp_rank = device_mesh.size(), device_mesh.get_local_rank()
        return module
