"""What every timing script shares: the timers, the copy-bandwidth yardstick, JSON and tables.

Numbers are medians (host timers: ``time.perf_counter`` over repeats after one warm-up call;
device timers: ``triton.testing.do_bench``, which clears L2 before each replay), so one slow
outlier does not move a result.  Triton is imported only by the device timers.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable, Mapping, Optional, Sequence

__all__ = ["synchronize", "host_median_s", "device_median_ms", "graph_time_us", "rotated_rounds", "copy_gbps",
           "write_json", "format_table"]


def synchronize(device) -> None:
    """Wait until ``device`` (a ``torch.device``) has run what was queued on it; nothing off CUDA."""
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


def host_median_s(fn: Callable[[], Any], repeat: int, *, sync: Optional[Callable[[], None]] = None) -> float:
    """Median wall seconds of ``fn()`` over ``repeat`` calls after one warm-up call.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs after each call, inside the timed span.
    """
    fn()
    if sync:
        sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_median_ms(fn: Callable[[], Any], **kwargs) -> float:
    """Median milliseconds of ``fn`` on the GPU (``triton.testing.do_bench``; kwargs pass through)."""
    from triton.testing import do_bench
    return do_bench(fn, return_mode="median", **kwargs)


def rotated_rounds(timers: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each timer's readings over ``rounds`` rounds: every round calls each timer once, the order moved
    one place each round, so no timer always takes the same slot.  Compare medians.

    A ratio of two GPU timings read once each, in a fixed order, is biased: after seconds without
    device work (set-up, compiles) the first kernels timed read fast, the first fastest.  On an H100,
    cuBLAS's qkv product at 4096 rows read 260-264 us in the first slot and 290-302 us in the next two
    rounds; the contract kernels timed after it in the first round read 266-297 us, slot by slot
    slower, and 289-297 us later (docs/benchmarks.md, 2026-12-06, second H100 session).
    """
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    if not timers:
        raise ValueError("rotated_rounds needs at least one timer")
    names = list(timers)
    readings: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            readings[name].append(timers[name]())
    return readings


def copy_gbps(n_bytes: int = 1 << 30, **kwargs) -> float:
    """GB/s (bytes read plus written, 1e9) of a device-to-device copy of ``n_bytes``: the
    bandwidth yardstick memory-bound kernels are compared with."""
    import torch
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = device_median_ms(lambda: dst.copy_(src), **kwargs)
    return 2 * n_bytes / ms / 1e6


def write_json(path: Optional[str], payload: Any, *, indent: int = 1, quiet: bool = False) -> None:
    """Write ``payload`` to ``path`` (its directory created); nothing when ``path`` is empty."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=indent)
    if not quiet:
        print(f"wrote {path}")


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]], *, floatfmt: str = ".3g") -> str:
    """A plain-text table: ``columns`` are ``(key, header)`` pairs; a missing value prints as ``-``."""
    def cell(v):
        if v is None:
            return "-"
        return format(v, floatfmt) if isinstance(v, float) else str(v)
    cells = [[h for _, h in columns]] + [[cell(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def graph_time_us(op: Callable[[int], Any], sets: int, est_us: float) -> float:
    """Median microseconds per call of ``op(i)`` (input set i), from CUDA-graph replays: one graph
    of many calls cycling through the ``sets`` input sets (so a working set larger than L2 is
    read from memory, as by successive layers), no Python launch cost in the time."""
    import torch
    calls = max(sets, min(64, int(1500 / max(est_us, 1.0))))
    calls += -calls % sets
    for i in range(sets):
        op(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(calls):
            op(c % sets)
    from triton.testing import do_bench
    ms = do_bench(graph.replay, warmup=5, rep=30, return_mode="median")
    del graph
    return ms * 1e3 / calls
