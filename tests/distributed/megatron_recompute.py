"""A megatron-core GPTModel with tpinv layers under megatron's own activation recompute (run in
spawned ranks): per setting, the losses of two steps, the last step's gradients (every parameter,
gathered to full shape), how many checkpointed regions megatron entered, and the bytes saved for
backward by one forward.

``"<setting>/no-replay"`` is the control: tpinv's dropout is not told about megatron's recompute,
so a recomputed dropout draws the next call's mask instead of the one it repeats.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_train import SEQ, _batches, config, gathered_weights

#: megatron-core TransformerConfig recompute settings, by name.
SETTINGS = {
    "none": {},
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}
STEPS = 2


def _model(kind, setting, tp, group):
    import tpinv.megatron as tm

    cfg = dataclasses.replace(config(kind, tp), **SETTINGS[setting])
    norm = "RMSNorm" if kind == "llama" else "LayerNorm"
    torch.manual_seed(0)
    return tm.build_gpt_model(cfg, tp_group=group, vocab_size=128, max_sequence_length=SEQ,
                              spec_kwargs=dict(normalization=norm),
                              position_embedding_type="rope" if kind == "llama" else "learned_absolute",
                              share_embeddings_and_output_weights=False, dropout_seed=7).train()


def _loss(model, b):
    return model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]).float().sum()


def run(kind, name, tp, group):
    """``(losses, grads, checkpoints entered, saved bytes)`` for ``name`` (a setting, or ``setting/no-replay``)."""
    from megatron.core import tensor_parallel

    import tpinv.megatron.dropout as dropout
    from tpinv.testing.saved_activations import saved_activation_bytes

    setting, _, control = name.partition("/")
    real_checkpoint, real_phase = tensor_parallel.checkpoint, dropout._megatron_checkpoint_phase
    entered = []
    tensor_parallel.checkpoint = lambda *a, **k: entered.append(1) or real_checkpoint(*a, **k)
    if control == "no-replay":
        dropout._megatron_checkpoint_phase = lambda: None
    try:
        model, losses = _model(kind, setting, tp, group), []
        for _, b in zip(range(STEPS), _batches()):
            model.zero_grad(set_to_none=True)
            loss = _loss(model, b)
            loss.backward()
            losses.append(loss.detach())
        grads, checkpoints = gathered_weights(model, group, grads=True), len(entered)
        fresh, b = _model(kind, setting, tp, group), next(_batches())
        saved = saved_activation_bytes(lambda: _loss(fresh, b), fresh.parameters())
    finally:
        tensor_parallel.checkpoint, dropout._megatron_checkpoint_phase = real_checkpoint, real_phase
    return torch.stack(losses), grads, checkpoints, saved


def worker(rank, world, runs):
    from megatron.core import parallel_state

    from tpinv.testing.megatron_cpu import megatron_cpu_shims

    megatron_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    try:
        out = {(kind, name): run(kind, name, world, group) for kind, name in runs}
    finally:
        parallel_state.destroy_model_parallel()
    return out if rank == 0 else None


def pipeline_worker(rank, world, tp, pp, recompute, no_replay=False):
    """megatron_pipeline's training run with ``recompute``; rank 0 returns its result and the number
    of megatron checkpoint calls it made (``no_replay``: the control, as in :func:`run`)."""
    from megatron.core import tensor_parallel

    import megatron_pipeline
    import tpinv.megatron.dropout as dropout

    real_checkpoint, real_phase = tensor_parallel.checkpoint, dropout._megatron_checkpoint_phase
    entered = []
    tensor_parallel.checkpoint = lambda *a, **k: entered.append(1) or real_checkpoint(*a, **k)
    if no_replay:
        dropout._megatron_checkpoint_phase = lambda: None
    try:
        result = megatron_pipeline.worker(rank, world, tp, pp, 7, recompute)
    finally:
        tensor_parallel.checkpoint, dropout._megatron_checkpoint_phase = real_checkpoint, real_phase
    return None if result is None else (result, len(entered))
