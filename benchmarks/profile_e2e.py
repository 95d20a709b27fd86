"""Where the time goes: torch.profiler over one training step and one decode step.

Builds the model of :mod:`tools.bench_e2e` (random weights), warms up, then profiles a
training step (``loss.backward``) and a greedy decode step against a KV cache, for the
invariant path or the vanilla path.  Prints the top device kernels by self device time and
the top operators by host time; ``--trace DIR`` also writes Chrome traces.  ``--host N``
instead runs N training steps under cProfile and prints the Python functions by own time (where
an eager step's host time goes); ``--host-decode N`` the same over N greedy decode steps.
``--anatomy N`` times N eager training steps of each path, taking turns, without a profiler: the
host time to issue the forward, to issue the backward, and the step's wall time (device synced);
where issuing takes as long as the step, the step is bound by host work.

    python -m benchmarks.profile_e2e --model qwen3-0.6b --path invariant
    python -m benchmarks.profile_e2e --model qwen3-0.6b --host 3
    python -m benchmarks.profile_e2e --model qwen3-0.6b --host-decode 20
    python -m benchmarks.profile_e2e --model qwen3-0.6b --anatomy 6
"""
from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

from tpinv.models.vanilla import vanilla_forward, vanilla_loss

from benchmarks.bench_e2e import build
from benchmarks.common import synchronize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--path", default="invariant", choices=["invariant", "vanilla"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--trace", default=None)
    p.add_argument("--host", type=int, default=0, help="cProfile this many training steps instead")
    p.add_argument("--host-decode", type=int, default=0, help="cProfile this many decode steps instead")
    p.add_argument("--anatomy", type=int, default=0, help="time this many eager training steps of "
                   "each path: host time of forward and backward, and wall time")
    p.add_argument("--dump", default=None, help="with --host/--host-decode: also write the cProfile "
                   "stats to this file (pstats.Stats(FILE).print_callers(...) reads it)")
    opts = p.parse_args()

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    name, _, layers = opts.model.partition(":")
    model = build(name, int(layers) if layers else None, torch.bfloat16, device)
    vocab = model.args.vocab_size
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (opts.batch, opts.seq), generator=gen).to(device)
    targets = torch.randint(0, vocab, (opts.batch, opts.seq), generator=gen).to(device)
    prompt = torch.randint(0, vocab, (opts.decode_batch, opts.prompt), generator=gen).to(device)
    invariant = opts.path == "invariant"

    def train_step():
        model.zero_grad(set_to_none=True)
        loss = model.loss(tokens, targets) if invariant else vanilla_loss(model, tokens, targets)
        loss.mean().backward()

    def forward(t, cache):
        return model(t, cache=cache) if invariant else vanilla_forward(model, t, cache=cache)

    if opts.anatomy:
        _anatomy(model, tokens, targets, opts.anatomy, device)
        return
    if opts.host:
        _host_profile(train_step, opts.host, opts.rows, device, "training", opts.dump)
        return
    if opts.host_decode:
        cache = model.new_cache(opts.decode_batch, opts.prompt + opts.host_decode + 4, device=device)
        with torch.no_grad():
            token = [forward(prompt, cache)[:, -1].argmax(-1, keepdim=True)]

            def decode_step():
                token[0] = forward(token[0], cache)[:, -1].argmax(-1, keepdim=True)

            _host_profile(decode_step, opts.host_decode, opts.rows, device, "decode", opts.dump)
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_device = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for label in ("train", "decode"):
        with torch.no_grad() if label == "decode" else torch.enable_grad():
            if label == "decode":
                cache = model.new_cache(opts.decode_batch, opts.prompt + 8, device=device)
                token = forward(prompt, cache)[:, -1].argmax(-1, keepdim=True)
                step = lambda: forward(token, cache)  # noqa: E731
            else:
                step = train_step
            step()  # warm-up (compiles kernels); a decode step advances the cache by one
            synchronize(device)
            with profile(activities=activities) as prof:
                step()
                synchronize(device)
        print(f"==== {opts.path} {label}: top kernels by self device time")
        print(prof.key_averages().table(sort_by=sort_device, row_limit=opts.rows, max_name_column_width=60))
        print(f"==== {opts.path} {label}: top operators by host time")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
        if opts.trace:
            os.makedirs(opts.trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(opts.trace, f"{opts.path}-{label}.json"))


def _anatomy(model, tokens, targets, steps: int, device: torch.device) -> None:
    """Median host time to issue the forward and the backward, and wall time, per path (taking turns)."""
    import statistics
    import time
    paths = {"invariant": model.loss, "vanilla": lambda t, y: vanilla_loss(model, t, y)}
    times = {name: [] for name in paths}
    for step in range(steps + 2):                      # two warm-up steps per path
        for name, loss_fn in paths.items():
            model.zero_grad(set_to_none=True)
            synchronize(device)
            t0 = time.perf_counter()
            loss = loss_fn(tokens, targets)
            t1 = time.perf_counter()
            loss.mean().backward()
            t2 = time.perf_counter()
            synchronize(device)
            if step >= 2:
                times[name].append((t1 - t0, t2 - t1, time.perf_counter() - t0))
    print(f"{'path':10s} {'forward issue ms':>17s} {'backward issue ms':>18s} {'wall ms':>8s}")
    for name, rows in times.items():
        med = [statistics.median(r[i] for r in rows) * 1e3 for i in range(3)]
        print(f"{name:10s} {med[0]:17.1f} {med[1]:18.1f} {med[2]:8.1f}")


def _host_profile(step, steps: int, rows: int, device: torch.device, label: str,
                  dump: str | None = None) -> None:
    """cProfile ``steps`` calls of ``step`` after two warm-ups: functions by own time, then by total."""
    import cProfile
    import pstats
    import time
    for _ in range(2):
        step()
    synchronize(device)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    synchronize(device)
    prof.disable()
    print(f"==== {steps} {label} steps: {(time.perf_counter() - start) / steps * 1e3:.1f} ms a step under cProfile")
    if dump:
        prof.dump_stats(dump)
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)


if __name__ == "__main__":
    main()
