"""A megatron-core training loop in the style of megatron's run_simple_mcore_train_loop example
(megatron DDP, get_megatron_optimizer with clip_grad=1.0, get_forward_backward_func), on CPU/gloo,
for a GPT-2-style and a Llama-style config; stock, spec-built or swapped in place."""
from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH, STEPS = 128, 8, 2, 4


def config(kind: str, tp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    common = dict(num_layers=2, tensor_model_parallel_size=tp, use_cpu_initialization=True,
                  bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
                  persist_layer_norm=False, gradient_accumulation_fusion=False, init_method_std=0.05,
                  params_dtype=torch.float32, pipeline_dtype=torch.float32)
    if kind == "example":  # megatron's run_simple_mcore_train_loop config, with the documented leaf setting
        cfg = TransformerConfig(hidden_size=12, num_attention_heads=4, **common)
        cfg.tpinv_leaves = 4
        return cfg
    if kind == "gpt2":  # LayerNorm, GeLU, biases, learned positions, dropout 0.1
        cfg = TransformerConfig(hidden_size=48, num_attention_heads=4, ffn_hidden_size=96, normalization="LayerNorm",
                                activation_func=torch.nn.functional.gelu, add_bias_linear=True,
                                hidden_dropout=0.1, attention_dropout=0.1, **common)
    else:  # Llama: RMSNorm, SwiGLU, GQA, RoPE, no biases
        cfg = TransformerConfig(hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128,
                                normalization="RMSNorm", gated_linear_unit=True,
                                activation_func=torch.nn.functional.silu, add_bias_linear=False,
                                hidden_dropout=0.0, attention_dropout=0.0, **common)
    return cfg


def _model(kind, variant, tp, group):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import tpinv.megatron as tm

    cfg = config(kind, tp)
    norm = "RMSNorm" if kind == "llama" else "LayerNorm"
    pos = "rope" if kind == "llama" else "learned_absolute"
    torch.manual_seed(0)
    if variant == "spec":
        return tm.build_gpt_model(cfg, tp_group=group, vocab_size=VOCAB, max_sequence_length=SEQ,
                                  spec_kwargs=dict(normalization=norm), position_embedding_type=pos,
                                  share_embeddings_and_output_weights=False, dropout_seed=7)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization=norm),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type=pos,
                     share_embeddings_and_output_weights=False)
    if variant == "swapped":
        tm.swap_to_tpinv(model, tp_group=group, dropout_seed=7)
    return model


def _batches():
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
               "position_ids": torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ),
               "attention_mask": torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None],
               "loss_mask": torch.ones(BATCH, SEQ)}


def _forward_step(data_iterator, model):
    from functools import partial
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

    def loss_func(loss_mask, output):
        loss = (output.float().view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach()}
    return out, partial(loss_func, b["loss_mask"])


def train(kind, variant, tp, group):
    """Losses, grad norms and the full (gathered) weights after STEPS steps."""
    gpt = _model(kind, variant, tp, group)
    losses, norms = run_steps(gpt, variant, group, _batches(), STEPS)
    return losses, norms, gathered_weights(gpt, group)


def run_steps(gpt, variant, group, data, steps):
    """``steps`` steps of megatron's loop (DDP, get_megatron_optimizer, get_forward_backward_func)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import tpinv.megatron as tm

    model = DistributedDataParallel(config=gpt.config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), module=gpt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, bf16=False, fp16=False,
                                                 params_dtype=torch.float32), [model])
    if variant != "stock":
        tm.use_invariant_grad_norm(opt, [model], tp_group=group)
    fbf = get_forward_backward_func()
    losses, norms = [], []
    for _ in range(steps):
        model.zero_grad_buffer()
        opt.zero_grad()
        out = fbf(forward_step_func=_forward_step, data_iterator=data, model=model, num_microbatches=1,
                  seq_length=SEQ, micro_batch_size=BATCH, decoder_seq_length=SEQ, forward_only=False)
        ok, norm, _ = opt.step()
        assert ok
        losses.append(out[0]["lm loss"])
        norms.append(norm)
    return losses, norms


def gathered_weights(model, group, grads=False):
    """Every parameter (or its ``.grad``) at full shape: TP shards gathered, stride-2 shards re-laid."""
    tp = dist.get_world_size(group)
    out = {}
    for name, p in model.named_parameters():
        t = p.detach() if not grads else p.grad
        if t is None:
            continue
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            stride = getattr(p, "partition_stride", 1) or 1
            if stride > 1:  # [gate_r; up_r] per rank -> [gate; up]
                parts = [torch.cat([q.chunk(stride, p.partition_dim)[j] for q in parts], p.partition_dim)
                         for j in range(stride)]
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t.clone()
    return out


def worker(rank, world, kinds=("gpt2", "llama", "example"), variants=("stock", "spec", "swapped")):
    from megatron.core import parallel_state

    from tpinv.testing.megatron_cpu import megatron_cpu_shims

    megatron_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    try:
        res = {(k, v): train(k, v, world, group) for k in kinds for v in variants}
    finally:
        parallel_state.destroy_model_parallel()
    return res if rank == 0 else None


def checkpoint_worker(rank, world, ckpt_dir, save):
    """With ``save``: train 2 steps, save with megatron's dist_checkpointing.  Then (either way) a
    fresh model loads the checkpoint and trains 2 more steps: the loaded weights and that curve."""
    from megatron.core import dist_checkpointing, parallel_state

    from tpinv.testing.megatron_cpu import megatron_cpu_shims

    import multiprocessing

    megatron_cpu_shims()
    # torch_dist saving starts a multiprocessing Manager; the test's rank processes are daemonic
    multiprocessing.current_process()._config["daemon"] = False
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    try:
        data = _batches()
        if save:
            gpt = _model("gpt2", "spec", world, group)
            run_steps(gpt, "spec", group, data, 2)
            dist_checkpointing.save(gpt.sharded_state_dict(), ckpt_dir)
        else:
            next(data), next(data)
        gpt = _model("gpt2", "spec", world, group)
        fresh = gathered_weights(gpt, group)
        gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), ckpt_dir))
        loaded = gathered_weights(gpt, group)
        losses, norms = run_steps(gpt, "spec", group, data, 2)
        out = (loaded, losses, norms, gathered_weights(gpt, group), fresh)
    finally:
        parallel_state.destroy_model_parallel()
    return out if rank == 0 else None
