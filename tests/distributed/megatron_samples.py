"""megatron's training loop (DDP, get_megatron_optimizer with clip_grad=1.0, get_forward_backward_func)
on the GPT-2-style tpinv model with dropout 0.1 (hidden and attention), a global batch of 4 samples
cut into micro-batches and data-parallel ranks as megatron's ``MegatronPretrainingSampler`` cuts them
(megatron/training/datasets/data_samplers.py: of each ``micro_batch * dp`` consecutive samples, DP rank
``d`` takes ``[d * micro_batch, (d + 1) * micro_batch)``).  Run in spawned ranks.

A run is ``(micro_batch, keying, lr[, precision, optimizer, variant])``; keying: ``"count"`` (the
default: each dropout site counts its samples), ``"ids"`` (``tpinv.megatron.dropout_sample_ids`` with
the sampler's global sample ids) or ``"row"`` (the control: a row keyed by its index in its
micro-batch); precision ``"fp32"`` or ``"bf16"`` (bf16 parameters in megatron's ``Float16Module``,
``OptimizerConfig(bf16=True)``: fp32 main parameters and gradient buffers); optimizer ``"plain"``,
``"distributed"`` (``use_distributed_optimizer=True``) or ``"distributed/shards"`` (the control: the
invariant norm without first gathering the reduced gradient shards); variant ``"tpinv"`` or ``"stock"`` (megatron's
own layers, RNG dropout and grad norm: the control).
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist

from megatron_train import SEQ, VOCAB, config, gathered_weights
from tpinv.testing import assert_same_bits

GLOBAL_BATCH, STEPS = 4, 4


def assert_same_run(got, ref, what: str) -> None:
    """Two workers' results (per-token losses, grad norms, final weights) are the same bits."""
    losses, norms, w, _ = got
    ref_losses, ref_norms, ref_w, _ = ref
    assert_same_bits(losses, ref_losses, f"{what}: per-token losses")
    assert norms == ref_norms, f"{what}: grad norms {norms} vs {ref_norms}"
    assert w.keys() == ref_w.keys() and len(w) > 10
    for name in ref_w:
        assert_same_bits(w[name], ref_w[name], f"{what}: {name} after 4 steps")


def sample(i: int) -> torch.Tensor:
    """The ``i``-th sample of the global stream (``SEQ + 1`` tokens)."""
    return torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(1000 + i))


def sampler_ids(step: int, micro_batch: int, dp: int, dp_rank: int):
    """The global sample ids of each micro-batch of ``step`` on DP rank ``dp_rank``, laid out as
    megatron's MegatronPretrainingSampler lays them out."""
    consumed = step * GLOBAL_BATCH
    for k in range(GLOBAL_BATCH // (micro_batch * dp)):
        yield consumed + k * micro_batch * dp + dp_rank * micro_batch + torch.arange(micro_batch)


def data(micro_batch: int, dp: int, dp_rank: int):
    for step in range(STEPS):
        for ids in sampler_ids(step, micro_batch, dp, dp_rank):
            tokens = torch.stack([sample(int(i)) for i in ids])
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "sample_ids": ids,
                   "position_ids": torch.arange(SEQ).unsqueeze(0).expand(micro_batch, SEQ),
                   "attention_mask": torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None],
                   "loss_mask": torch.ones(micro_batch, SEQ)}


def forward_step(keying, data_iterator, model):
    import tpinv.megatron as tm

    b = next(data_iterator)
    named = tm.dropout_sample_ids(model, b["sample_ids"]) if keying == "ids" else contextlib.nullcontext()
    with named:
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

    def loss_func(loss_mask, output):
        loss = (output.float().view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach(), "token losses": output.detach().float(), "ids": b["sample_ids"]}
    return out, partial(loss_func, b["loss_mask"])


def _gpt(cfg, variant, tp_group):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import tpinv.megatron as tm

    kwargs = dict(vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="learned_absolute",
                  share_embeddings_and_output_weights=False)
    torch.manual_seed(0)
    if variant == "stock":
        return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
                        **kwargs)
    return tm.build_gpt_model(cfg, tp_group=tp_group, spec_kwargs=dict(normalization="LayerNorm"), dropout_seed=7,
                              **kwargs)


def trainer_norm(gpt, tp_group, leaves):
    """tpinv's trainer's norm (``tpinv.training.optim.global_grad_norm``) of the model's ``main_grad``s."""
    from tpinv.training.optim import ParamLayout, global_grad_norm

    layout = ParamLayout(gpt, dist.get_world_size(tp_group))
    flat = torch.cat([p.main_grad.float().reshape(-1) for p in layout.params.values()])
    return global_grad_norm(flat, layout, tp_group, leaves)


@contextlib.contextmanager
def _norm_of_own_shards():
    """The control: the invariant norm taken without gathering the reduce-scattered shards."""
    import tpinv.megatron.grad_norm as grad_norm

    real, grad_norm.gather_reduced_grads = grad_norm.gather_reduced_grads, lambda chunks: None
    try:
        yield
    finally:
        grad_norm.gather_reduced_grads = real


def train(micro_batch, keying, lr, precision="fp32", optimizer="plain", variant="tpinv", *, tp_group, dp_group):
    """``(token losses by sample id, grad norms, full weights, tpinv's trainer's norm of the first
    step's gradients)`` after STEPS steps (the last: plain optimizer only, else None)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    import tpinv.megatron as tm
    import tpinv.megatron.dropout as dropout
    from tpinv.core.contract import DEFAULT_LEAVES

    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    cfg = config("gpt2", dist.get_world_size(tp_group))
    cfg.params_dtype = cfg.pipeline_dtype = dtype
    cfg.bf16 = precision == "bf16"
    cfg.finalize_model_grads_func = finalize_model_grads  # megatron's: the DP all-reduce after the last backward
    gpt = _gpt(cfg, variant, tp_group)
    if keying == "row":
        for site in dropout.dropout_sites(gpt):
            site._counted_ids = lambda rows, device: torch.arange(rows, device=device)
    distributed = optimizer.startswith("distributed")
    model = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed),
        module=Float16Module(cfg, gpt) if cfg.bf16 else gpt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, clip_grad=1.0, bf16=cfg.bf16,
                                                 params_dtype=dtype, use_distributed_optimizer=distributed), [model])
    if variant == "tpinv":
        tm.use_invariant_grad_norm(opt, [model], tp_group=tp_group)
    fbf, it, losses, norms, first = get_forward_backward_func(), data(micro_batch, dp, dp_rank), {}, [], None
    micro = GLOBAL_BATCH // (micro_batch * dp)
    with _norm_of_own_shards() if optimizer == "distributed/shards" else contextlib.nullcontext():
        for _ in range(STEPS):
            model.zero_grad_buffer()
            opt.zero_grad()
            out = fbf(forward_step_func=partial(forward_step, keying), data_iterator=it, model=model,
                      num_microbatches=micro, seq_length=SEQ, micro_batch_size=micro_batch, decoder_seq_length=SEQ,
                      forward_only=False)
            if not norms and not distributed:
                first = trainer_norm(gpt, tp_group, getattr(cfg, "tpinv_leaves", None) or DEFAULT_LEAVES)
            ok, norm, _ = opt.step()
            assert ok
            norms.append(norm)
            for o in out:
                losses.update({int(i): row for i, row in zip(o["ids"], o["token losses"])})
    every = [None] * dp
    dist.all_gather_object(every, losses, group=dp_group)
    losses = {i: row for part in every for i, row in part.items()}
    assert sorted(losses) == list(range(STEPS * GLOBAL_BATCH))
    return torch.stack([losses[i] for i in sorted(losses)]), norms, gathered_weights(gpt, tp_group), first


def worker(rank, world, tp, runs):
    """``runs``: tuples of :func:`train`'s arguments; rank 0 returns ``{run: train(*run)}``."""
    from megatron.core import parallel_state

    from tpinv.testing.megatron_cpu import megatron_cpu_shims

    megatron_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group()
        out = {run: train(*run, tp_group=tp_group, dp_group=dp_group) for run in runs}
    finally:
        parallel_state.destroy_model_parallel()
    return out if rank == 0 else None
