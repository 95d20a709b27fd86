"""A small Embedding -> Column -> Row -> Column(vocab) -> cross-entropy stack, tpinv or megatron.

Run in spawned ranks; returns full (gathered) logits, per-token loss and every parameter
gradient gathered to the full tensor, so results from different TP sizes can be compared.
Biases are non-zero (the same full draw at every TP size, each rank keeping its shard).
:func:`row_gradients` runs the Column -> Row -> Column(vocab) part on float inputs and returns
each input row's gradient computed in the batch and alone.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist

V, H, F, B, S = 64, 32, 64, 3, 5


def _config(dtype):
    return types.SimpleNamespace(params_dtype=dtype, perform_initialization=True, use_cpu_initialization=True,
                                 sequence_parallel=False, gradient_accumulation_fusion=False)


def _init(w):
    return torch.nn.init.normal_(w, 0.0, 0.3)


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    targets = torch.randint(0, V, (B, S), generator=g)
    return ids, targets


def _gather(t, group, dim):
    if dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _full_grads(modules, group):
    out = {}
    for name, mod in modules.items():
        for pname, p in mod.named_parameters():
            g = p.grad
            if getattr(p, "tensor_model_parallel", False):
                g = _gather(g, group, p.partition_dim)
            out[f"{name}.{pname}"] = g
    return out


def _nonzero_biases(modules, group):
    """Every bias gets the same full draw at every TP size; a sharded bias keeps its rank's chunk."""
    gen = torch.Generator().manual_seed(7)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    with torch.no_grad():
        for mod in modules:
            b = getattr(mod, "bias", None)
            if b is None:
                continue
            sharded = getattr(b, "tensor_model_parallel", False)
            shape = list(b.shape)
            if sharded:
                shape[b.partition_dim] *= world
            full = 0.3 * torch.randn(shape, generator=gen)
            b.copy_((full.chunk(world, dim=b.partition_dim)[rank] if sharded else full).to(b.dtype))
            assert b.abs().sum() > 0


def run_tpinv(group, dtype, strategy):
    from tpinv.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from tpinv.layers import vocab_parallel_cross_entropy
    from tpinv.testing import record_ops

    cfg = _config(dtype)
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(V, H, init_method=_init, config=cfg, tp_group=group)
    fc1 = ColumnParallelLinear(H, F, config=cfg, init_method=_init, bias=True, tp_group=group)
    fc2 = RowParallelLinear(F, H, config=cfg, init_method=_init, bias=True, input_is_parallel=True,
                            skip_bias_add=False, tp_group=group, strategy=strategy)
    head = ColumnParallelLinear(H, V, config=cfg, init_method=_init, bias=False, tp_group=group)
    _nonzero_biases((fc1, fc2), group)
    ids, targets = inputs()
    with record_ops() as seen:
        x = emb(ids)
        h, _ = fc1(x)
        h, _ = fc2(torch.tanh(h))
        logits, _ = head(h)
        loss = vocab_parallel_cross_entropy(logits, targets, tp_group=group)
        loss.sum().backward()
    # the contract's matmul: rounded in the op where no partial crosses ranks, fp32 partials where one does
    assert "tpinv::matmul" in seen or "tpinv::matmul_partial" in seen, f"the invariant matmul did not run: {seen}"
    assert "aten::mm" not in seen and "aten::addmm" not in seen, f"a BLAS matmul ran: {seen}"
    return {"logits": _gather(logits.detach(), group, -1), "loss": loss.detach(),
            "grads": _full_grads({"emb": emb, "fc1": fc1, "fc2": fc2, "head": head}, group)}


def run_megatron(group, dtype):
    """The same stack from megatron-core's own layers (the negative control)."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                               vocab_parallel_cross_entropy)

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size(group))
    group = parallel_state.get_tensor_model_parallel_group()
    cfg = ModelParallelConfig(tensor_model_parallel_size=dist.get_world_size(group), params_dtype=dtype,
                              use_cpu_initialization=True, perform_initialization=True)
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(V, H, init_method=_init, config=cfg, tp_group=group)
    fc1 = ColumnParallelLinear(H, F, config=cfg, init_method=_init, bias=True, tp_group=group)
    fc2 = RowParallelLinear(F, H, config=cfg, init_method=_init, bias=True, input_is_parallel=True,
                            skip_bias_add=False, tp_group=group)
    head = ColumnParallelLinear(H, V, config=cfg, init_method=_init, bias=False, tp_group=group)
    _nonzero_biases((fc1, fc2), group)
    ids, targets = inputs()
    x = emb(ids)
    h, _ = fc1(x)
    h, _ = fc2(torch.tanh(h))
    logits, _ = head(h)
    loss = vocab_parallel_cross_entropy(logits.float().clone(), targets)  # it works in place
    loss.sum().backward()
    return {"logits": _gather(logits.detach(), group, -1), "loss": loss.detach(),
            "grads": _full_grads({"emb": emb, "fc1": fc1, "fc2": fc2, "head": head}, group)}


def row_gradients(group, leaves):
    """Input gradients of Column -> Row -> Column(vocab) -> loss (fp32, tree strategy): each
    row's gradient from the whole batch (``batch``) and from the row run alone (``alone``)."""
    from tpinv.layers import ColumnParallelLinear, RowParallelLinear, vocab_parallel_cross_entropy

    cfg = _config(torch.float32)
    torch.manual_seed(0)
    fc1 = ColumnParallelLinear(H, F, config=cfg, init_method=_init, bias=True, tp_group=group, leaves=leaves)
    fc2 = RowParallelLinear(F, H, config=cfg, init_method=_init, bias=True, input_is_parallel=True,
                            skip_bias_add=False, tp_group=group, leaves=leaves)
    head = ColumnParallelLinear(H, V, config=cfg, init_method=_init, bias=False, tp_group=group, leaves=leaves)
    _nonzero_biases((fc1, fc2), group)
    g = torch.Generator().manual_seed(3)
    x, weights = torch.randn(B, S, H, generator=g), torch.rand(B, S, generator=g)
    _, targets = inputs()

    def input_grad(rows):
        xr = x[rows].clone().requires_grad_()
        h, _ = fc1(xr)
        h, _ = fc2(torch.tanh(h))
        logits, _ = head(h)
        vocab_parallel_cross_entropy(logits, targets[rows], tp_group=group, leaves=leaves).backward(weights[rows])
        return xr.grad

    return {"batch": input_grad(slice(None)), "alone": torch.cat([input_grad(slice(b, b + 1)) for b in range(B)])}


def worker(rank, world, megatron):
    group = dist.new_group(list(range(world)))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for strategy in ("tree", "column_only"):
            out[(str(dtype), strategy)] = run_tpinv(group, dtype, strategy)
        if megatron:
            out[(str(dtype), "megatron")] = run_megatron(group, dtype)
    for leaves in (8, 4):
        out[("rows", leaves)] = row_gradients(group, leaves)
    return out if rank == 0 else None
