"""End to end on one device: a training step and greedy decoding, invariant path vs vanilla.

The invariant path is the model itself (:class:`tpinv.models.Transformer`: the tpinv ops in
their CUDA slots); the vanilla path is :mod:`tpinv.models.vanilla` on the same weights
(cuBLAS, SDPA, ``F.silu``, plain RMSNorm).  Two measurements, each the median of repeated
runs after a warm-up, in the same process, the two paths taking turns run by run:

* training step: ``loss(tokens, targets).backward(w)`` at ``--batch x --seq`` tokens;
  ratio = invariant time / vanilla time (the target is <= 1.25).  The invariant eager step is the
  default one, its decoder layers replayed from recorded programs (:mod:`tpinv.models.replayed_layer`;
  three warm-up calls: first sight, record, check); its modular step (replay off) is timed in the
  same rounds, and on CUDA each path's peak memory is reported.  On CUDA each path is also
  timed replayed from a CUDA graph (the device time alone; the invariant graph's gradients
  are checked equal to the eager step's, bitwise), and compiled (``tpinv.compile`` of the
  invariant loss, ``torch.compile`` of the vanilla one; the compiled invariant step's loss and
  gradients are checked equal to the eager step's, bitwise; compile time is reported apart;
  where ``tpinv.compile`` refuses the installed torch, the vanilla one is compiled and timed
  alone, so each path's best is still reported).
* decoding: a prompt of ``--prompt`` tokens is prefilled into a KV cache, then ``--new``
  greedy steps of one token for each of ``--decode-batch`` sequences; tokens/s of the decode
  steps; ratio = invariant tokens/s / vanilla tokens/s (the target is >= 0.75).  Each path is
  timed eager and, on CUDA, replayed from a CUDA graph (:class:`tpinv.engine.decode_graph.DecodeGraph`;
  vanilla's graph attends through the masked SDPA call, as it cannot pick its unmasked
  shortcut without reading the positions on the host).

Before timing, the invariant decode (eager, and replayed on CUDA) is checked against the
invariant prefill of the same tokens (the last position's logits, bitwise) and the run stops
if they differ.
Prints a table; ``--json`` writes the records.  Runs on CPU too (a check of the script).

``--peers`` (on CUDA by default when transformers is installed; ``--no-peers`` skips it) adds
Hugging Face transformers on the same shapes and workloads (:mod:`benchmarks.peers_e2e`): its
eager training step, its eager decoding (dynamic cache) and its compiled static-cache decoding,
with tpinv's time over HF's in the table; and, when the public ``batch_invariant_ops`` package
can be imported, HF's eager training and decoding under its batch-invariant mode.

``--memory issue`` adds peak memory beside time for tpinv, vanilla and HF transformers at the
shapes of :data:`benchmarks.memory_e2e.ISSUE_CASES` (forward without grad, a training step, and
the log-probs of one 32k-token sequence); ``--memory tiny`` runs them at a tiny shape (CPU);
``--memory-only`` skips the measurements above.

    python -m benchmarks.bench_e2e --model qwen3-0.6b --json out.json
    python -m benchmarks.bench_e2e --memory issue --memory-only --json memory.json
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.common import host_median_s, synchronize as sync, write_json
from benchmarks.memory_e2e import ISSUE_CASES, TINY_CASES, format_rows, run_cases
from benchmarks.peers_e2e import hf_available, hf_times, print_peers
from tpinv.layers.linear_cross_entropy import LOG_PROB_CHUNK_TOKENS
from tpinv.core.dtypes import dtype_from_name
from tpinv.core.capture import capture
from tpinv.core.compile import compile as tpinv_compile
from tpinv.testing.bits import same_bits
from tpinv.engine.decode_graph import DecodeGraph
from tpinv.models import Transformer, get_config
from tpinv.models.replayed_layer import REPLAY, replay_counts
from tpinv.models.vanilla import vanilla_forward, vanilla_loss


def build(name: str, layers: int | None, dtype: torch.dtype, device) -> Transformer:
    """Random weights from seed 0 (the same for both paths), on ``device``."""
    overrides = {"dtype": dtype} if layers is None else {"dtype": dtype, "num_layers": layers}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Transformer(get_config(name, **overrides))
    return model.to(device)


def train_step_times(model, device, batch: int, seq: int, iters: int, compiled: bool = False) -> dict:
    gen = torch.Generator().manual_seed(11)
    vocab = model.args.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    weights = (torch.rand(batch, seq, generator=gen) / (batch * seq)).to(device)

    def step(loss_fn):
        def run():
            model.zero_grad(set_to_none=True)
            loss_fn(tokens, targets).backward(weights)
        return run

    paths = {"invariant": model.loss, "vanilla": lambda t, y: vanilla_loss(model, t, y)}
    out = {"tokens": batch * seq}
    runs = {name: step(loss_fn) for name, loss_fn in paths.items()}
    runs["invariant_modular"] = step(lambda t, y: modular_loss(model, t, y))
    medians = interleaved_medians(runs, device, iters, warmup=3)
    out.update({f"{name}_s": seconds for name, seconds in medians.items()})
    out["ratio_time"] = out["invariant_s"] / out["vanilla_s"]
    out["replay_counts"] = replay_counts()
    out["replayed"] = out["replay_counts"]["replay"] > 0
    if device.type == "cuda":
        out.update({f"{name}_peak_bytes": peak_bytes(run, device) for name, run in runs.items()})
    eager_grads = train_grads(model, step(model.loss)) if device.type == "cuda" or compiled else None
    if device.type == "cuda":  # the same steps replayed from CUDA graphs: device time only
        try:
            out.update(graphed_train_times(model, paths, step, eager_grads, device, iters))
        except RuntimeError as exc:  # reported in the table and the JSON, the rest still runs
            out["graph_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    if compiled:
        out.update(compiled_train_times(model, paths, step, (tokens, targets), eager_grads, device, iters))
    model.zero_grad(set_to_none=True)
    return out


def compiled_train_times(model, paths, step, inputs, eager_grads, device, iters) -> dict:
    """Each path's loss compiled -- ``tpinv.compile`` (full graph, the eager bits) for the invariant
    path, plain ``torch.compile`` for the vanilla one -- and timed as the eager steps are (the
    paths taking turns).  The first call of each (tracing and compiling) is timed apart, and the
    compiled invariant step's loss and gradients are compared with the eager step's, bitwise."""
    out = {}
    compiled = {"vanilla": torch.compile(paths["vanilla"])}
    try:
        compiled["invariant"] = tpinv_compile(model.loss)
    except NotImplementedError as exc:   # tpinv.compile refuses a torch below its floor: vanilla alone
        out["compiled_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    tokens, targets = inputs
    eager_loss = model.loss(tokens, targets).detach()
    for name, loss_fn in compiled.items():
        sync(device)
        t0 = time.perf_counter()
        step(loss_fn)()
        sync(device)
        out[f"{name}_compile_s"] = time.perf_counter() - t0
    if "invariant" in compiled:
        grads = train_grads(model, step(compiled["invariant"]))
        out["compiled_grads_equal_eager"] = _all_same_bits(grads, eager_grads)
        # with grad mode on, as the timed steps: the training graph, not a second (inference) compile
        out["compiled_loss_equal_eager"] = same_bits(compiled["invariant"](tokens, targets).detach(), eager_loss)
    medians = interleaved_medians({name: step(fn) for name, fn in compiled.items()}, device, iters)
    out.update({f"{name}_compiled_s": seconds for name, seconds in medians.items()})
    if "invariant" in compiled:
        out["ratio_time_compiled"] = out["invariant_compiled_s"] / out["vanilla_compiled_s"]
    return out


def modular_loss(model, tokens, targets):
    """``model.loss`` with eager replay off: every decoder layer runs its modular code."""
    REPLAY[0] = False
    try:
        return model.loss(tokens, targets)
    finally:
        REPLAY[0] = True


def peak_bytes(run, device) -> int:
    """Peak device memory allocated during ``run()`` (a training step), from the memory held before it."""
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    sync(device)
    return torch.cuda.max_memory_allocated(device)


def interleaved_medians(runs: dict, device, iters: int, warmup: int = 1) -> dict:
    """Median seconds of each ``runs[name]()`` over ``iters`` rounds, the paths taking turns in
    each round after ``warmup`` calls of each (a host whose speed drifts during the run, as the lent
    machines' hosts do, then weighs on every path alike).  A training step needs 3: eager replay
    (:mod:`tpinv.models.replayed_layer`) records a layer on its second call and checks it on its third."""
    times = {name: [] for name in runs}
    for run in runs.values():
        for _ in range(warmup):
            run()
    for _ in range(iters):
        for name, run in runs.items():
            sync(device)
            t0 = time.perf_counter()
            run()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def graphed_train_times(model, paths, step, eager_grads, device, iters) -> dict:
    """Each path's step captured in a CUDA graph and timed by its replays (device time); the
    invariant replay's gradients are compared with ``eager_grads``."""
    out = {}
    for name, loss_fn in paths.items():
        replay = capture(step(loss_fn), device=device)[0].replay
        if name == "invariant":
            replay()
            out["graph_grads_equal_eager"] = _all_same_bits(train_grads(model, lambda: None), eager_grads)
        out[f"{name}_graph_s"] = host_median_s(replay, iters, sync=lambda: sync(device))
    out["ratio_time_graph"] = out["invariant_graph_s"] / out["vanilla_graph_s"]
    return out


def _all_same_bits(got: list, want: list) -> bool:
    """Whether two lists of tensors are equal in length, shapes, dtypes and raw bytes."""
    return len(got) == len(want) and all(same_bits(a, b) for a, b in zip(got, want))


def train_grads(model, run) -> list[torch.Tensor]:
    """``run()``, then a copy of every parameter's gradient."""
    run()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def decode_step(forward, model, cache, graph: bool):
    """``step(tokens [B, 1]) -> logits``: one greedy step against ``cache``, eager or replayed."""
    ones = torch.ones(cache.batch, dtype=torch.int64, device=cache.lengths.device)
    run = (lambda t, p, v: forward(t, p, cache, v))
    if graph:
        run = DecodeGraph(run, cache, model.args.vocab_size)
    return lambda tokens: run(tokens, cache.next_positions(1), ones)


def greedy_decode(forward, model, prompt: torch.Tensor, new: int, device, graph: bool
                  ) -> tuple[float, torch.Tensor]:
    """Seconds of ``new`` one-token steps (prefill and the first step, which captures, excluded)."""
    batch = prompt.shape[0]
    cache = model.new_cache(batch, prompt.shape[1] + new + 1, device=device)
    logits = forward(prompt, None, cache, None)
    step = decode_step(forward, model, cache, graph)
    logits = step(logits[:, -1].argmax(-1, keepdim=True))
    token = logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(new):
        logits = step(token)
        token = logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    return time.perf_counter() - t0, logits[:, -1]


def check_decode_equals_prefill(model, device, batch: int, prompt_len: int, graph: bool) -> bool:
    """Decoding the last prompt token against the cache (eager, or replayed from a CUDA graph)
    == prefilling the whole prompt, bitwise."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, model.args.vocab_size, (batch, prompt_len), generator=gen).to(device)
    forward = (lambda t, p, c, v: model(t, p, c, num_valid=v))
    with torch.no_grad():
        full = model(tokens)[:, -1]
        cache = model.new_cache(batch, prompt_len + 8, device=device)
        model(tokens[:, :-1], cache=cache)
        step = decode_step(forward, model, cache, graph)(tokens[:, -1:])[:, -1]
    return torch.equal(full, step)


def decode_rates(model, device, batch: int, prompt_len: int, new: int, repeats: int, modes) -> dict:
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, model.args.vocab_size, (batch, prompt_len), generator=gen).to(device)
    paths = {"invariant": lambda t, p, c, v: model(t, p, c, num_valid=v),
             "vanilla": lambda t, p, c, v: vanilla_forward(model, t, p, c, num_valid=v)}
    out = {"decode_batch": batch, "prompt": prompt_len, "new_tokens": new}
    with torch.no_grad():
        for mode in modes:   # the paths take turns in each repeat (see interleaved_medians)
            graph = mode == "graph"
            for forward in paths.values():
                greedy_decode(forward, model, prompt, min(new, 4), device, graph)  # warm-up
            runs = {name: [] for name in paths}
            for _ in range(repeats):
                for name, forward in paths.items():
                    runs[name].append(greedy_decode(forward, model, prompt, new, device, graph)[0])
            for name, seconds in runs.items():
                out[f"{name}_{mode}_tokens_per_s"] = batch * new / sorted(seconds)[len(seconds) // 2]
            out[f"ratio_rate_{mode}"] = out[f"invariant_{mode}_tokens_per_s"] / out[f"vanilla_{mode}_tokens_per_s"]
    return out


def progress(message: str) -> None:
    """One line on stderr as each part finishes, so a run cut short by a time limit still says what it measured."""
    print(f"[bench_e2e] {message}", file=sys.stderr, flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b", help="config name, optionally :LAYERS")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--json", default=None)
    p.add_argument("--memory", choices=["issue", "tiny"], default=None,
                   help="also measure peak memory beside time (tpinv, vanilla, HF) at these shapes")
    p.add_argument("--memory-only", action="store_true", help="only the --memory cases")
    p.add_argument("--chunk-tokens", type=int, default=LOG_PROB_CHUNK_TOKENS,
                   help="chunk_tokens of the chunked cross-entropy / log-prob paths")
    p.add_argument("--compiled", action="store_true",
                   help="also time the training step compiled (tpinv.compile vs torch.compile of vanilla)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None,
                   help="also time HF transformers (default: on CUDA when transformers is installed)")
    opts = p.parse_args(argv)
    if opts.memory_only and opts.memory is None:
        p.error("--memory-only needs --memory issue or --memory tiny")

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    memory = None
    if opts.memory:
        memory = run_cases(ISSUE_CASES if opts.memory == "issue" else TINY_CASES, dtype=dtype_from_name(opts.dtype),
                           device=device, iters=opts.iters, chunk=opts.chunk_tokens)
        print("\n".join(format_rows(memory)))
    if opts.memory_only:
        if opts.json:
            write_json(opts.json, {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                   "dtype": opts.dtype, "memory": memory}, indent=2)
        return
    name, _, layers = opts.model.partition(":")
    model = build(name, int(layers) if layers else None, dtype_from_name(opts.dtype), device)
    params = sum(t.numel() for t in model.parameters())
    modes = ["eager", "graph"] if device.type == "cuda" else ["eager"]
    for mode in modes:
        if not check_decode_equals_prefill(model, device, 2, min(opts.prompt, 200), mode == "graph"):
            raise SystemExit(f"FAIL: the invariant decode step ({mode}) differs from the invariant prefill")
    progress(f"decode == prefill bitwise ({', '.join(modes)}); timing the training step")
    train = train_step_times(model, device, opts.batch, opts.seq, opts.iters, opts.compiled)
    progress(f"train step: invariant {train['invariant_s']:.4f} s, vanilla {train['vanilla_s']:.4f} s; "
             f"timing decode")
    decode = decode_rates(model, device, opts.decode_batch, opts.prompt, opts.new, opts.repeats, modes)
    progress("decode: " + ", ".join(f"{mode} {decode[f'invariant_{mode}_tokens_per_s']:.1f} / "
                                    f"{decode[f'vanilla_{mode}_tokens_per_s']:.1f} tok/s" for mode in modes))
    peers = {}
    want_peers = opts.peers if opts.peers is not None else (device.type == "cuda" and hf_available() is None)
    if want_peers:
        if hf_available() is not None:
            raise SystemExit(f"--peers: {hf_available()}")
        progress("timing the HF transformers peers")
        peers = hf_times(model, device, batch=opts.batch, seq=opts.seq, iters=opts.iters,
                         decode_batch=opts.decode_batch, prompt_len=opts.prompt, new=opts.new, repeats=opts.repeats)
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {dev}; model {opts.model} ({params / 1e6:.0f} M params), {opts.dtype}; "
          f"decode == prefill bitwise ({', '.join(modes)}): yes")
    print(f"{'measure':<40} {'invariant':>12} {'vanilla':>12} {'ratio':>7} {'target':>8}")
    train_label = f"train step s ({train['tokens']} tokens)"
    print(f"{train_label:<40} {train['invariant_s']:>12.4f} "
          f"{train['vanilla_s']:>12.4f} {train['ratio_time']:>7.2f} {'<= 1.25':>8}")
    label = f"  eager replay ran: {train['replayed']}; modular"
    print(f"{label:<40} {train['invariant_modular_s']:>12.4f} {train['vanilla_s']:>12.4f} "
          f"{train['invariant_modular_s'] / train['vanilla_s']:>7.2f}")
    if "invariant_peak_bytes" in train:
        label = "  peak GB: replayed, modular / vanilla"
        print(f"{label:<40} {train['invariant_peak_bytes'] / 1e9:>6.2f} {train['invariant_modular_peak_bytes'] / 1e9:>5.2f}"
              f" {train['vanilla_peak_bytes'] / 1e9:>12.2f}")
    if "graph_error" in train:
        print(f"train step, CUDA graph: not captured ({train['graph_error'][:300]})")
    if "invariant_graph_s" in train:
        label = f"train step s, CUDA graph (grads == eager: {train['graph_grads_equal_eager']})"
        print(f"{label:<40} {train['invariant_graph_s']:>12.4f} "
              f"{train['vanilla_graph_s']:>12.4f} {train['ratio_time_graph']:>7.2f} {'<= 1.0':>8}")
        # a ratio well above 1: the eager step is its host's time, not its device's
        label = "train step, eager over CUDA graph"
        print(f"{label:<40} {train['invariant_s'] / train['invariant_graph_s']:>12.2f} "
              f"{train['vanilla_s'] / train['vanilla_graph_s']:>12.2f}")
    if "compiled_error" in train:
        print(f"train step, compiled (invariant): not run ({train['compiled_error'][:300]})")
    if "invariant_compiled_s" in train:
        same = train["compiled_loss_equal_eager"] and train["compiled_grads_equal_eager"]
        label = f"train step s, compiled (== eager: {same})"
        print(f"{label:<40} {train['invariant_compiled_s']:>12.4f} "
              f"{train['vanilla_compiled_s']:>12.4f} {train['ratio_time_compiled']:>7.2f} {'<= 1.0':>8}")
    elif "vanilla_compiled_s" in train:
        label = "train step s, compiled (vanilla only)"
        print(f"{label:<40} {'-':>12} {train['vanilla_compiled_s']:>12.4f} {'-':>7} {'':>8}")
    if "vanilla_compiled_s" in train:
        firsts = ", ".join(f"{path} {train[f'{path}_compile_s']:.1f} s" for path in ("invariant", "vanilla")
                           if f"{path}_compile_s" in train)
        print(f"  (first call, tracing and compiling: {firsts})")
        # only here: a best without vanilla's compiled step would flatter tpinv
        best = {path: min(train[k] for k in (f"{path}_s", f"{path}_graph_s", f"{path}_compiled_s") if k in train)
                for path in ("invariant", "vanilla")}
        label = "train step s, each path's best"
        print(f"{label:<40} {best['invariant']:>12.4f} {best['vanilla']:>12.4f} "
              f"{best['invariant'] / best['vanilla']:>7.2f} {'<= 1.0':>8}")
        train["best_s"] = best
    for mode in modes:
        label = f"decode tok/s (batch {opts.decode_batch}, {mode})"
        print(f"{label:<40} {decode[f'invariant_{mode}_tokens_per_s']:>12.1f} "
              f"{decode[f'vanilla_{mode}_tokens_per_s']:>12.1f} {decode[f'ratio_rate_{mode}']:>7.2f} "
              f"{'>= 0.75':>8}")
    if peers:
        print_peers(peers, train, decode, opts.decode_batch)
    if opts.json:
        write_json(opts.json, {"device": dev, "model": opts.model, "params": params, "dtype": opts.dtype,
                               "train": train, "decode": decode, "peers": peers, "memory": memory}, indent=2)


if __name__ == "__main__":
    main()
