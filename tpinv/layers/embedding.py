"""TP-invariant ``VocabParallelEmbedding`` (megatron-core's signature).

Forward: each rank looks up the ids of its vocabulary shard (zeros elsewhere) and the
tree reducer adds the shards' rows in fp32; exactly one shard holds each row, so the sum
is exact and equal to the TP=1 lookup.  Backward: each table row's gradient is the sum of
its tokens' gradients as a sequential chain in token order (``tpinv::embedding_backward``);
a row lives on one rank and sees the same tokens in the same order at every TP size.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from tpinv.core.autograd import apply_function
from tpinv.distributed.groups import group_size, group_size_rank
from tpinv.layers.common import check_layer_sizes, config_leaves, init_sharded_weight, params_dtype
from tpinv.layers.common import reject_unsupported
from tpinv.core.capture import check_range
from tpinv.ops import embedding_backward
from tpinv.ops.embedding import IGNORED_ID
from tpinv.distributed.reduce import tree_all_reduce


class _VocabParallelLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, start, group, leaves):
        n = weight.shape[0]
        local = ids - start
        outside = (local < 0) | (local >= n)
        local = local.masked_fill(outside, 0)
        out = torch.nn.functional.embedding(local, weight)
        ctx.save_for_backward(local, outside)
        ctx.sharded = group_size(group) > 1
        ctx.num_rows, ctx.dtype = n, weight.dtype
        if ctx.sharded:
            out = out.masked_fill(outside.unsqueeze(-1), 0)
            out = tree_all_reduce(out.float(), group, leaves=leaves).to(weight.dtype)
        return out

    @staticmethod
    def backward(ctx, dy):
        local, outside = ctx.saved_tensors
        grad, ids = dy.reshape(-1, dy.shape[-1]), local.reshape(-1)
        if ctx.sharded:  # other ranks' tokens add to no row here (one TP group: none exist)
            ids = ids.masked_fill(outside.reshape(-1), IGNORED_ID)
        dw = embedding_backward(grad, ids, ctx.num_rows).to(ctx.dtype)
        return None, dw, None, None, None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by rows (the vocabulary) across the TP group."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Optional[Callable],
        reduce_scatter_embeddings: bool = False,
        config: Any,
        tp_group: Optional[dist.ProcessGroup] = None,
        leaves: Optional[int] = None,
    ):
        super().__init__()
        name = type(self).__name__
        reject_unsupported(name, reduce_scatter_embeddings=(reduce_scatter_embeddings, False))
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size_rank(tp_group)
        self.leaves = config_leaves(config, leaves)
        self.num_embeddings_per_partition = check_layer_sizes(
            name, "num_embeddings", num_embeddings, self.tp_size, self.leaves)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        device = torch.device("cuda", torch.cuda.current_device()) if (
            torch.cuda.is_available() and not getattr(config, "use_cpu_initialization", False)) else None
        self.weight = init_sharded_weight(
            (num_embeddings, embedding_dim), init_method, 0, self.tp_size, self.tp_rank, params_dtype(config),
            device, getattr(config, "perform_initialization", True))
        self.weight.tensor_model_parallel, self.weight.partition_dim, self.weight.partition_stride = True, 0, 1

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if input_.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"token ids must be int64 or int32, got {input_.dtype}")
        n = self.num_embeddings   # in the graph under torch.compile; a capture's runner checks
        check_range(input_, n, lambda low, high: IndexError(
            f"token id {high if high >= n else low} is outside the vocabulary [0, {n})"), "token id")
        return apply_function(_VocabParallelLookup, input_.long(), self.weight, self.vocab_start_index,
                              self.tp_group, self.leaves)
