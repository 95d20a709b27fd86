"""Time the tree reducer's algorithms against ``dist.all_reduce`` on the same fp32 tensors.

Each algorithm of :func:`tpinv.distributed.reduce.tree_all_reduce` is timed per message size
(median of repeated timings after a warm-up; each timing is the slowest rank's, after a
barrier) next to a plain sum ``all_reduce``, and checked bitwise against the
single-process tree over all ranks' partials.  Bus bandwidth is ``2(C-1)/C * bytes / time``;
``vs_all_reduce`` is ``all_reduce time / algorithm time`` (above 1: faster).  Algorithms
run with ``check=False`` unless ``--check``; the ``+check`` row times ``"auto"`` with the
cross-rank shape check as the layers run it (once per call signature, so the timed calls repeat
a verified one), the ``+check always`` row with a check of every call (one more small
collective and a host sync).

    python -m benchmarks.bench_reduce --world 4                    # spawns gloo ranks on CPU
    torchrun --nproc-per-node 2 -m benchmarks.bench_reduce --backend nccl --json out.json
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.common import synchronize, write_json
from tpinv.core.contract import tree_combine_list
from tpinv.distributed.reduce import ALGORITHMS, algorithms_for, choose_algorithm, tree_all_reduce

CPU_SIZES = "4K,16K,64K,256K,1M,4M"
GPU_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536 bytes (suffixes K, M, G; powers of 1024)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * _UNITS[unit])


def _time(fn, device, warmup: int, iters: int) -> float:
    """Median over ``iters`` of the slowest rank's seconds for one call of ``fn``."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = torch.zeros(iters, dtype=torch.float64, device=device)
    for i in range(iters):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times[i] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist())


def bench(sizes: list[int], algorithms: list[str], warmup: int, iters: int,
          check: bool) -> list[dict]:
    """Run on every rank of the initialized default group; returns the records (all ranks)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
        else torch.device("cpu")
    records = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        g = torch.Generator().manual_seed(1234)
        partials = [torch.randn(n, generator=g).to(device) for _ in range(world)]
        mine, reference = partials[rank], tree_combine_list(partials)
        plain = mine.clone()
        dist.all_reduce(plain)
        base = _time(lambda: dist.all_reduce(mine.clone()), device, warmup, iters)
        rows = [("all_reduce", base, torch.equal(plain, reference))]
        valid = [a for a in algorithms if a == "auto" or a in algorithms_for(world)]
        runs = [(a, check) for a in valid] + ([("auto", True)] if not check else []) + [("auto", "always")]
        group = dist.group.WORLD
        for algorithm, checked in runs:
            out = tree_all_reduce(mine, group, algorithm=algorithm, check=checked)
            seconds = _time(lambda: tree_all_reduce(mine, group, algorithm=algorithm,
                                                    check=checked), device, warmup, iters)
            label = algorithm if algorithm != "auto" else \
                f"auto({choose_algorithm(n * 4, world, 'nccl' if mine.is_cuda else 'gloo')})"
            suffix = "+check always" if checked == "always" else "+check" if checked and not check else ""
            rows.append((label + suffix, seconds, torch.equal(out, reference)))
        for label, seconds, equal in rows:
            records.append({
                "bytes": n * 4, "algorithm": label, "world": world, "backend": backend,
                "time_us": seconds * 1e6,
                "busbw_GBps": 2 * (world - 1) / world * n * 4 / seconds / 1e9,
                "vs_all_reduce": base / seconds, "bitwise_equal_tree": bool(equal)})
    return records


def format_table(records: list[dict]) -> str:
    head = f"{'size':>9} {'algorithm':>29} {'time_us':>10} {'busbw_GB/s':>11} " \
           f"{'vs_all_reduce':>14} {'== tree':>8}"
    lines = [head, "-" * len(head)]
    for r in records:
        size = r["bytes"]
        label = f"{size >> 20}M" if size >= 1 << 20 else f"{size >> 10}K" if size >= 1024 \
            else f"{size}B"
        lines.append(f"{label:>9} {r['algorithm']:>29} {r['time_us']:>10.1f} "
                     f"{r['busbw_GBps']:>11.3f} {r['vs_all_reduce']:>13.2f}x "
                     f"{'yes' if r['bitwise_equal_tree'] else 'no':>8}")
    return "\n".join(lines)


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    return bench(args.sizes, args.algorithms, args.warmup, args.iters, args.check)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2,
                   help="ranks to spawn when not started by torchrun (default 2)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    p.add_argument("--sizes", default=None,
                   help=f"comma-separated message sizes (default GPU {GPU_SIZES}; CPU {CPU_SIZES})")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS + ("auto",)))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--check", action="store_true",
                   help="time with the cross-rank shape check on (off by default)")
    p.add_argument("--json", default=None, help="write the records to this path")
    args = p.parse_args(argv)
    args.backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    args.sizes = [parse_size(s) for s in
                  (args.sizes or (GPU_SIZES if args.backend == "nccl" else CPU_SIZES)).split(",")]
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if "RANK" in os.environ:  # under torchrun
        if args.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=300))
        records = _rank_main(dist.get_rank(), dist.get_world_size(), args)
        is_main = dist.get_rank() == 0
        dist.destroy_process_group()
    else:
        from tpinv.testing import run_ranks
        records = run_ranks(_rank_main, args.world, args, backend=args.backend, timeout=3600.0,
                            pg_timeout=300.0, threads=None if args.backend == "nccl" else 1)[0]
        is_main = True
    if is_main:
        print(format_table(records))
        write_json(args.json, records)


if __name__ == "__main__":
    main()
