"""A tiny megatron-core GPTModel on CPU/gloo, stock or with tpinv layers (run in spawned ranks).

In bf16 every model is cast to bf16 as megatron's ``Float16Module`` casts it (``module.bfloat16()``):
the local spec's ``torch.nn.RMSNorm`` ignores ``params_dtype`` and is built with fp32 weights, and
torch 2.6's RMSNorm returns fp32 for a bf16 input with fp32 weights, which megatron's bf16 linears
refuse (torch 2.7 and newer return the input's dtype).

megatron-core assumes CUDA in places; ``tpinv.testing.megatron_cpu`` replaces those for the test
process only (tpinv itself never patches megatron).  Besides logits and loss, the loss's
gradients (every parameter, gathered to full shape) are returned.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH = 256, 16, 2


def cpu_shims():
    from tpinv.testing.megatron_cpu import megatron_cpu_shims

    megatron_cpu_shims()


def _config(tp, dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, init_method_std=0.05)


def _inputs():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    return tokens, labels, pos, mask


def _run(model, group):
    from megatron_train import gathered_weights

    tokens, labels, pos, mask = _inputs()
    with torch.no_grad():
        logits = model(tokens, pos, mask)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, pos, mask, labels=labels)
    loss.float().mean().backward()
    grads = gathered_weights(model, group, grads=True)
    if dist.get_world_size(group) > 1:
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return logits, loss.detach(), grads


def worker(rank, world):
    return {str(dtype): _worker_dtype(rank, world, dtype) for dtype in (torch.float32, torch.bfloat16)}


def _worker_dtype(rank, world, dtype):
    cpu_shims()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import tpinv.megatron as tm
    from tpinv.layers import ColumnParallelLinear, RowParallelLinear
    from tpinv.testing import record_ops

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    cfg = _config(world, dtype)
    out = {}
    torch.manual_seed(0)
    stock = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope").to(dtype)
    assert {p.dtype for p in stock.parameters()} == {dtype}
    out["stock"] = _run(stock, group)
    tm.swap_to_tpinv(stock, tp_group=group)  # in place, keeping the weights
    with record_ops() as seen:
        out["swapped"] = _run(stock, group)
    assert "tpinv::matmul" in seen or "tpinv::matmul_partial" in seen   # the contract's matmul, either form
    torch.manual_seed(0)
    built = tm.build_gpt_model(cfg, tp_group=group, vocab_size=VOCAB, max_sequence_length=SEQ,
                               spec_kwargs=dict(normalization="RMSNorm"), position_embedding_type="rope").to(dtype)
    kinds = {type(m) for m in built.modules()}
    assert any(issubclass(k, ColumnParallelLinear) for k in kinds)
    assert any(issubclass(k, RowParallelLinear) for k in kinds)
    out["spec"] = _run(built, group)
    parallel_state.destroy_model_parallel()
    return out if rank == 0 else None
