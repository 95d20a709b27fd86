"""The decoder at TP=8 (8 gloo ranks) and with KV heads replicated (TP above the KV-head count).

``qwen3-kv8-tiny`` splits its 8 KV heads 8 ways; ``qwen3-kv2-tiny`` has 2 KV heads, held by
2 ranks each at TP=4 and by 4 at TP=8.  Logits, per-token losses and every parameter
gradient (the full tensor, one copy of each replicated shard) equal TP=1's bytes.
Sequence parallelism (norms and residuals on sequence chunks, the row layers' tree
reduce-scatter, the column layers' all-gather) gives the bits of SP off at TP 2, 4 and 8.
No weight is all-gathered: every all-gather's input is checked against the parameters'
storage.  Negative control: the same weights on the vanilla path (:mod:`tpinv.models.vanilla`: BLAS,
row-parallel partials rounded and added by a plain all_reduce) give other logits at TP 4
and 8 than at TP=1.
"""
from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.distributed as dist

from tpinv.distributed import reduce
from tpinv.distributed.reduce import all_gather
from tpinv.models import Transformer, get_config
from tpinv.models.vanilla import vanilla_forward
from tpinv.testing import assert_bits_differ, assert_same_bits, record_ops, run_ranks

B, S = 2, 8


def inputs():
    gen = torch.Generator().manual_seed(11)
    return (torch.randint(0, 256, (B, S), generator=gen), torch.randint(0, 256, (B, S), generator=gen),
            torch.rand(B, S, generator=gen))


def full_tensor(t, p, group):
    """The full tensor of a (possibly replicated) shard: gather, keep one copy per shard."""
    if group is None or not getattr(p, "tensor_model_parallel", False):
        return t.detach().clone()
    full = all_gather(t.detach().contiguous(), group, dim=p.partition_dim)
    r = getattr(p, "tpinv_replicas", 1)
    if r == 1:
        return full
    chunks = full.chunk(dist.get_world_size(group), dim=p.partition_dim)
    return torch.cat(chunks[::r], dim=p.partition_dim)


@contextlib.contextmanager
def gathers_of(model):
    """Record every exact all-gather the model runs; ``weights`` lists those whose input shares a
    parameter's storage (a weight all-gathered), ``count`` all of them."""
    orig = reduce.all_gather
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {"count": 0, "weights": []}

    def recording(t, group, **kw):
        seen["count"] += 1
        if t.untyped_storage().data_ptr() in storages:
            seen["weights"].append(tuple(t.shape))
        return orig(t, group, **kw)

    users = [m for m in list(sys.modules.values()) if getattr(m, "all_gather", None) is orig]
    for m in users:
        m.all_gather = recording
    try:
        yield seen
    finally:
        for m in users:
            m.all_gather = orig


def run_model(rank, world_size, names, dtype, tokens, targets, weights, sequence_parallel=False):
    group = dist.group.WORLD if world_size > 1 else None
    out = []
    for name in names:
        torch.manual_seed(0)
        model = Transformer(get_config(name, dtype=dtype), tp_group=group, sequence_parallel=sequence_parallel)
        assert model.sequence_parallel == (sequence_parallel and world_size > 1)
        with record_ops() as log, gathers_of(model) as gathers:
            logits = model(tokens, gather_logits=True).detach()
            loss = model.loss(tokens, targets)
            loss.backward(weights)
        assert any(op.startswith("tpinv::attention") for op in log.names), log.names
        assert not gathers["weights"], f"{name}: weights all-gathered: {gathers['weights']}"
        assert world_size == 1 or gathers["count"] > 0, "no all-gather recorded: the check saw nothing"
        grads = {n: full_tensor(p.grad, p, group) for n, p in model.named_parameters()}
        with torch.no_grad():
            vanilla = vanilla_forward(model, tokens, gather_logits=True)
        out.append({"logits": logits, "loss": loss.detach(), "grads": grads, "vanilla": vanilla,
                    "replicas": model.layers[0].self_attn.replicas})
    return out if rank in (0, world_size - 1) else None


def check_same(result, expected, where):
    assert_same_bits(result["logits"], expected["logits"], f"{where}: logits")
    assert_same_bits(result["loss"], expected["loss"], f"{where}: loss")
    assert result["grads"].keys() == expected["grads"].keys()
    for n, g in expected["grads"].items():
        assert_same_bits(result["grads"][n], g, f"{where}: grad of {n}")


NAMES = ("qwen3-kv8-tiny", "qwen3-kv2-tiny")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_tp8_and_replicated_kv_heads_equal_tp1(dtype):
    tokens, targets, weights = inputs()
    tp1 = run_model(0, 1, NAMES, dtype, tokens, targets, weights)
    for tp in (4, 8):
        ranks = run_ranks(run_model, tp, NAMES, dtype, tokens, targets, weights, timeout=300)
        for rank in (0, tp - 1):
            for name, got, want in zip(NAMES, ranks[rank], tp1):
                check_same(got, want, f"{name} {dtype} TP={tp} rank {rank}")
            # negative control: Megatron's plain path (rank-order all_reduce of rounded partials)
            for name, got, want in zip(NAMES, ranks[0], tp1):
                assert_bits_differ(got["vanilla"], want["vanilla"], f"{name} {dtype} vanilla TP={tp} vs TP=1")
        kv2 = ranks[0][1]["replicas"]
        assert kv2 == tp // 2, f"qwen3-kv2-tiny at TP={tp}: expected {tp // 2} replicas, got {kv2}"


def test_tp_not_a_multiple_of_kv_heads_is_refused():
    from tpinv.core.contract import InvarianceError
    from tpinv.models import check_model_sizes
    args = get_config("qwen3-tiny").replace(num_heads=12, num_kv_heads=3)
    with pytest.raises(InvarianceError, match="num_kv_heads=3"):
        check_model_sizes(args, 4, 8)


@pytest.mark.slow
@pytest.mark.parametrize("tp", (2, 4, 8))
def test_sequence_parallel_equals_sp_off(tp):
    tokens, targets, weights = inputs()
    dtype = torch.float32
    tp1 = run_model(0, 1, ("qwen3-kv2-tiny",), dtype, tokens, targets, weights)[0]
    ranks = run_ranks(run_model, tp, ("qwen3-kv2-tiny",), dtype, tokens, targets, weights, True, timeout=300)
    for rank in (0, tp - 1):
        check_same(ranks[rank][0], tp1, f"SP on, TP={tp} rank {rank}")


def test_sequence_parallel_control_norm_grad_split_by_rank_differs():
    """Negative control: the norm weight gradient as Megatron's SP forms it -- each rank's token
    sum over its sequence chunk, the partials then added in rank order -- differs from the
    whole-sequence token chain that tpinv's SP norm keeps."""
    from tpinv.ops.norm import rms_norm_backward_op
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(2, 8, 64, generator=gen), torch.randn(2, 8, 64, generator=gen)
    w = 1.0 + 0.1 * torch.randn(64, generator=gen)
    whole = rms_norm_backward_op(dy, x, w, 1e-6)[1]
    parts = [rms_norm_backward_op(d.contiguous(), c.contiguous(), w, 1e-6)[1]
             for c, d in zip(x.chunk(8, dim=1), dy.chunk(8, dim=1))]
    split = parts[0]
    for p in parts[1:]:
        split = split + p
    assert_bits_differ(split, whole, "per-chunk norm weight gradients added in rank order vs the whole chain")
