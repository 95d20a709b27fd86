"""megatron's pipeline schedule (get_forward_backward_func, 1F1B over several micro-batches) on a
tpinv GPT model: PP=2 x TP=2 against PP=1 x TP=1, on CPU/gloo (run in spawned ranks).

Both runs give every parameter the same values, drawn by *global* name (the layer index is the
global layer number), so a stage's slice of the model starts equal to the PP=1 model's."""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from megatron_train import SEQ, BATCH, VOCAB, _forward_step, config

MICRO, STEPS = 2, 3


def _init_by_name(model, group):
    from tpinv.megatron.grad_norm import global_parameter_names

    names = global_parameter_names(model)
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    with torch.no_grad():
        for p in model.parameters():
            g = torch.Generator().manual_seed(zlib.crc32(names[id(p)].encode()))
            full = list(p.shape)
            dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            if dim is not None:
                full[dim] *= tp
            master = torch.randn(full, generator=g) * 0.05
            if dim is not None:
                stride = getattr(p, "partition_stride", 1) or 1
                block = full[dim] // (tp * stride)
                master = torch.cat(master.split(block, dim)[rank::tp], dim)
            p.copy_(master)


def _data():
    g = torch.Generator().manual_seed(11)
    first = 0
    while True:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        first += BATCH
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "sample_ids": torch.arange(first - BATCH, first),
               "position_ids": torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ),
               "attention_mask": torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None],
               "loss_mask": torch.ones(BATCH, SEQ)}


def _forward_step_with_ids(data_iterator, model):
    """megatron_train's forward step, the model call inside ``tpinv.megatron.dropout_sample_ids``
    (every stage reads the micro-batch's ids: the test gives each stage the same data stream)."""
    import tpinv.megatron as tm
    from tpinv.megatron.dropout import dropout_sites

    b = next(data_iterator)
    with tm.dropout_sample_ids(model, b["sample_ids"]):
        out = _forward_step(iter([b]), model)
    sites = dropout_sites(model)
    assert sites and all(site.samples == 0 for site in sites), "the sites counted instead of taking the ids"
    return out


def worker(rank, world, tp, pp, dropout_seed=7, recompute=None, sample_ids=False):
    """``recompute``: megatron TransformerConfig recompute fields (e.g. ``recompute_granularity``);
    ``sample_ids``: name the rows with ``tpinv.megatron.dropout_sample_ids`` instead of counting them."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import tpinv.megatron as tm
    from tpinv.megatron.grad_norm import global_parameter_names
    from tpinv.testing.megatron_cpu import megatron_cpu_shims

    megatron_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        cfg = config("gpt2", tp)
        cfg.pipeline_model_parallel_size = pp
        for key, value in (recompute or {}).items():
            setattr(cfg, key, value)
        first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
        gpt = tm.build_gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=first,
                                 post_process=last, spec_kwargs=dict(normalization="LayerNorm"),
                                 position_embedding_type="learned_absolute",
                                 share_embeddings_and_output_weights=False, dropout_seed=dropout_seed)
        _init_by_name(gpt, group)
        model = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), module=gpt)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0,
                                                     params_dtype=torch.float32), [model])
        tm.use_invariant_grad_norm(opt, [model], tp_group=group, pp_group=pp_group)
        fbf, data, losses, norms = get_forward_backward_func(), _data(), [], []
        for _ in range(STEPS):
            model.zero_grad_buffer()
            opt.zero_grad()
            step_func = _forward_step_with_ids if sample_ids else _forward_step
            out = fbf(forward_step_func=step_func, data_iterator=data, model=model, num_microbatches=MICRO,
                      seq_length=SEQ, micro_batch_size=BATCH, decoder_seq_length=SEQ, forward_only=False)
            ok, norm, _ = opt.step()
            assert ok
            losses.append([o["lm loss"] for o in out])
            norms.append(norm)
        from megatron_train import gathered_weights
        names = global_parameter_names(gpt)
        local = gathered_weights(gpt, group)
        weights = {names[id(p)]: local[n] for n, p in gpt.named_parameters()}
        every = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(every, (losses if last else None, weights), group=pp_group)
        result = ([w for w in every if w[0] is not None][0][0], norms, {k: v for _, w in every for k, v in w.items()})
    finally:
        parallel_state.destroy_model_parallel()
    return result if rank == 0 else None
