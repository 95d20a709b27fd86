"""``tpinv.rl.grpo.full_weights`` / ``sync_weights`` with replicated KV heads (TP above the kv-head count).

A model of 2 kv heads at TP=4 keeps each kv head on two ranks.  Gathered from TP=4 ranks, the
full weights are the TP=1 model's, byte for byte (a replicated shard counted once); synced into
an engine at TP=4, every rank holds the trainer's own shard.  Negative control: the piece an
even split over the 4 ranks would give rank 1 (ignoring the replication) is not that rank's k
projection.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpinv.io.checkpoint import shard_index
from tpinv.models import Transformer, get_config
from tpinv.rl.grpo import full_weights, sync_weights
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks

MODEL = "qwen3-kv2-tiny"
K_PROJ = "layers.0.self_attn.k_proj.weight"


def sync_case(rank, world_size):
    cfg = get_config(MODEL)
    group = dist.group.WORLD
    torch.manual_seed(0)
    trainer = Transformer(cfg, tp_group=group)
    full = full_weights(trainer, group)
    torch.manual_seed(1)  # another init: sync must overwrite every byte
    engine = Transformer(cfg, tp_group=group)
    specs = {n: (tuple(t.shape), t.dtype) for n, t in full.items()}
    sync_weights(full if rank == 0 else None, engine, specs)
    k = dict(trainer.named_parameters())[K_PROJ]
    naive = full[K_PROJ][shard_index(full[K_PROJ].shape, int(k.partition_dim), world_size, rank)]
    return (full if rank == 0 else None,
            {n: p.detach().clone() for n, p in trainer.named_parameters()},
            {n: p.detach().clone() for n, p in engine.named_parameters()},
            getattr(k, "tpinv_replicas", 1), naive)


def test_weights_sync_across_tp_sizes_with_replicated_kv_heads():
    results = run_ranks(sync_case, 4)
    torch.manual_seed(0)
    whole = dict(Transformer(get_config(MODEL)).named_parameters())
    full = results[0][0]
    assert full.keys() == whole.keys()
    for name, p in whole.items():
        assert_same_bits(full[name], p.detach(), f"gathered {name}")
    for rank, (_, trainer, engine, replicas, naive) in enumerate(results):
        assert replicas == 2, "each kv head is held by two of the four ranks"
        for name, p in trainer.items():
            assert_same_bits(engine[name], p, f"rank {rank} synced {name}")
        if rank == 1:  # control: rank 1 holds kv head 0 (as rank 0 does), not the even split's piece 1
            assert_bits_differ(naive, trainer[K_PROJ], "an even split ignoring the replication")
