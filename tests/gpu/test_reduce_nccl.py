"""The tree reducer over NCCL: after a call signature's first check, checked calls never wait for
the device.

The cross-rank check reads gathered descriptors on the host, which waits for every kernel queued
before it; a rank checks each signature once and trusts it afterwards.  Under
``torch.cuda.set_sync_debug_mode("error")`` any call that synchronizes the device raises: the
checked tree all-reduce (every algorithm), reduce-scatter and all-gather, each made once before,
run there and return the one-process tree's bits.  Controls: ``check="always"`` and a plain
``.item()`` raise under the same mode, and ranks that pass different shapes still get the
reducer's error on every rank.  Skips without two CUDA devices.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tpinv.core.contract import tree_combine_list
from tpinv.distributed.reduce import all_gather, tree_all_reduce, tree_reduce_scatter
from tpinv.testing import assert_same_bits, caught, run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _rank(rank, world, parts):
    mine = parts[rank].cuda()
    group = dist.group.WORLD
    algorithms = ("auto", "all_gather", "all_to_all")

    def calls():
        return ({a: tree_all_reduce(mine, group, algorithm=a) for a in algorithms},
                tree_reduce_scatter(mine, group, dim=0), all_gather(mine, group, dim=0))

    calls()   # each signature's first call: checked across the ranks
    torch.cuda.synchronize()
    out = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        out["reduce"], out["scatter"], out["gather"] = calls()
        out["always"] = caught(lambda: tree_all_reduce(mine, group, check="always"))   # control
        out["item"] = caught(lambda: mine.sum().item())                               # control
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    dist.barrier()
    shape = (6, 5) if rank == 0 else (6, 3)
    out["mismatch"] = caught(lambda: tree_all_reduce(torch.ones(shape, device="cuda"), group))
    out["reduce"] = {a: t.cpu() for a, t in out["reduce"].items()}
    out["scatter"], out["gather"] = out["scatter"].cpu(), out["gather"].cpu()
    return out


def test_checked_collectives_wait_for_the_device_only_at_a_first_call():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(8, 1000, generator=gen) * 10.0 ** torch.randint(-3, 4, (8, 1000), generator=gen)
             for _ in range(2)]
    results = run_ranks(_rank, 2, parts, backend="nccl", timeout=240)
    tree = tree_combine_list(parts)
    for rank, r in enumerate(results):
        for algorithm, got in r["reduce"].items():
            assert_same_bits(got, tree, f"rank {rank} {algorithm}")
        assert_same_bits(r["scatter"], tree[rank * 4:(rank + 1) * 4], f"rank {rank} scatter")
        assert_same_bits(r["gather"], torch.cat(parts), f"rank {rank} gather")
        # Controls: a check of every call, and a plain .item(), synchronize: the mode raises.
        assert r["always"] is not None and "synchroniz" in r["always"][1], r["always"]
        assert r["item"] is not None and "synchroniz" in r["item"][1], r["item"]
        kind, message = r["mismatch"]
        assert kind == "InvarianceError" and "(6, 5)" in message and "(6, 3)" in message
