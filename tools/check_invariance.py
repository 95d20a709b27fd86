#!/usr/bin/env python3
"""Run a model at every (TP size x batch size) and report the seed paper's reproducibility metrics.

For each configuration every prompt is decoded greedily with a KV cache, placed at a
seeded random position in batches of exactly ``batch`` requests (filler requests pad the
last batch), on a TP group of that size.  Reported, across the K configurations (the
definitions of Zhang et al., "Deterministic Inference across Tensor Parallel Sizes", 5.1):

* count of unique outputs per prompt: ``|unique({y_1..y_K})|`` (1 = identical everywhere);
* maximum probability divergence: at each generated position ``i``, ``Delta_i`` = the largest
  spread (max - min over the K configurations) of the top-5 probabilities; the average over
  positions and prompts (0 = bitwise identical distributions).

Both metrics are :mod:`tpinv.engine.metrics`'s (the definitions the mismatch report uses).

``--paths invariant,vanilla`` (default) runs tpinv and the plain torch/BLAS/all_reduce control
on the same weights; ``--vanilla`` runs the control alone.  Spawns its own gloo ranks (world =
the largest TP size) unless started by torchrun.  Exits 1 if the invariant path is not
bitwise reproducible, 2 on bad arguments (a model source that does not exist or does not split
at a TP size: refused before any rank starts).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-tiny", help="named config, tpinv checkpoint dir or HF dir")
    p.add_argument("--tp", default="1,2,4", help="TP sizes, comma separated")
    p.add_argument("--batch", default="1,3,8", help="batch sizes, comma separated")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paths", default="invariant,vanilla",
                   help="which paths run, comma separated: invariant (tpinv), vanilla (the plain-torch control)")
    p.add_argument("--vanilla", action="store_true", help="run only the vanilla control")
    p.add_argument("--quick", action="store_true", help="4 prompts, 6 new tokens (a smoke run)")
    p.add_argument("--json", default="runs/check_invariance.json",
                   help="where the summary is written (default: %(default)s, under the current directory)")
    a = p.parse_args(argv)
    try:
        a.tp = [int(x) for x in a.tp.split(",")]
        a.batch = [int(x) for x in a.batch.split(",")]
    except ValueError:
        p.error(f"--tp {a.tp!r} and --batch {a.batch!r}: expected whole numbers, comma separated")
    a.paths = ["vanilla"] if a.vanilla else a.paths.split(",")
    if a.quick:
        a.prompts, a.new_tokens = 4, 6
    bad = [x for x in a.paths if x not in ("invariant", "vanilla")]
    if bad or min(a.batch) < 1 or a.prompts < 1 or a.new_tokens < 1:
        p.error(f"bad --paths {bad}" if bad else "--batch, --prompts and --new-tokens must be positive")
    from tpinv.io.loading import check_source
    try:   # before any rank starts: the model source, and every TP size against its sizes
        check_source(a.model, a.tp)
    except (ValueError, OSError) as e:
        p.error(f"--model {a.model} at --tp {','.join(map(str, a.tp))}: {' '.join(str(e).split())}")
    return a


def make_prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]


def decode_batch(model, forward, prompts, new_tokens, leaves):
    """Greedy decoding of a batch of prompts; per request: tokens and top-5 (ids, probs) per step."""
    from tpinv.ops import softmax

    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    tokens = torch.zeros(b, width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
    cache = model.new_cache(b, width + new_tokens)
    with torch.no_grad():
        logits = forward(model, tokens, None, cache, num_valid=lengths, gather_logits=True)
        last = logits[torch.arange(b), lengths - 1]
        out = [[] for _ in range(b)]
        for step in range(new_tokens):
            probs = softmax(last.float(), leaves)
            top = torch.topk(probs, 5, dim=-1)
            nxt = top.indices[:, 0]
            for i in range(b):
                out[i].append((int(nxt[i]), top.values[i]))
            if step + 1 < new_tokens:
                logits = forward(model, nxt[:, None], None, cache, gather_logits=True)
                last = logits[:, 0]
    return out


def run_config(model, forward, prompts, batch, new_tokens, seed, leaves):
    """Decode every prompt in batches of exactly ``batch`` at seeded random positions."""
    g = torch.Generator().manual_seed(seed * 7919 + batch)
    order = torch.randperm(len(prompts), generator=g).tolist()
    fillers = make_prompts(batch, model.args.vocab_size, seed + 1000 + batch)
    results = {}
    for start in range(0, len(order), batch):
        ids = order[start:start + batch]
        slots = torch.randperm(batch, generator=g).tolist()
        group = list(fillers)
        for k, i in enumerate(ids):
            group[slots[k]] = prompts[i]
        decoded = decode_batch(model, forward, group, new_tokens, leaves)
        for k, i in enumerate(ids):
            results[i] = decoded[slots[k]]
    return [results[i] for i in range(len(prompts))]


def rank_main(rank, world, a):
    from tpinv.core.dtypes import dtype_from_name
    from tpinv.io.loading import load_model
    from tpinv.models.vanilla import vanilla_forward

    groups = {t: dist.new_group(list(range(t))) for t in a.tp}
    dtype = dtype_from_name(a.dtype)
    forwards = {"invariant": lambda m, *x, **k: m(*x, **k), "vanilla": vanilla_forward}
    runs = {}
    for tp in a.tp:
        if rank >= tp:
            continue
        model, _ = load_model(a.model, tp_group=groups[tp], dtype=dtype, init_seed=a.seed)
        prompts = make_prompts(a.prompts, model.args.vocab_size, a.seed)
        for path in a.paths:
            for batch in a.batch:
                t0 = time.perf_counter()
                runs[(path, tp, batch)] = run_config(model, forwards[path], prompts, batch, a.new_tokens,
                                                     a.seed, model.leaves)
                if rank == 0:
                    print(f"  {path:9s} TP={tp} batch={batch}: {time.perf_counter() - t0:.1f} s", flush=True)
    return runs if rank == 0 else None


def metrics(runs, path, n_prompts):
    from tpinv.engine.metrics import count_unique_outputs, max_probability_divergence

    configs = sorted(k for k in runs if k[0] == path)
    unique, divergences, positions = [], [], 0
    for p in range(n_prompts):
        outs = [runs[c][p] for c in configs]
        unique.append(count_unique_outputs([[step[0] for step in o] for o in outs]))
        divergences.append(max_probability_divergence([torch.stack([step[1] for step in o]) for o in outs]))
        positions += min(len(o) for o in outs)
    return {"configs": [f"TP={c[1]},batch={c[2]}" for c in configs],
            "avg_unique_outputs": sum(unique) / len(unique), "unique_outputs_per_prompt": unique,
            "avg_max_prob_divergence": sum(divergences) / len(divergences),
            "positions_compared": positions}


def report(a, runs):
    summary = {"model": a.model, "dtype": a.dtype, "tp": a.tp, "batch": a.batch, "prompts": a.prompts,
               "new_tokens": a.new_tokens, "paths": {}}
    print(f"\n{'path':10s} {'configs':>7s} {'avg unique outputs':>19s} {'avg max prob divergence':>24s}")
    for path in a.paths:
        m = metrics(runs, path, a.prompts)
        summary["paths"][path] = m
        print(f"{path:10s} {len(m['configs']):7d} {m['avg_unique_outputs']:19.3f} "
              f"{m['avg_max_prob_divergence']:24.3e}")
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {a.json}")
    ok = True
    if "invariant" in summary["paths"]:
        m = summary["paths"]["invariant"]
        ok = m["avg_unique_outputs"] == 1.0 and m["avg_max_prob_divergence"] == 0.0
        print("invariant: " + ("bitwise identical outputs and probabilities in every configuration" if ok
                               else "NOT reproducible -- this is a bug"))
    if "vanilla" in summary["paths"]:
        m = summary["paths"]["vanilla"]
        same = m["avg_unique_outputs"] == 1.0 and m["avg_max_prob_divergence"] == 0.0
        print("vanilla:   " + ("identical here (try more prompts, tokens or bf16)" if same else
                               f"{m['avg_unique_outputs']:.2f} unique outputs per prompt, probabilities "
                               f"differ by {m['avg_max_prob_divergence']:.2e} on average"))
    return ok


def main(argv=None):
    a = parse_args(argv)
    world = max(a.tp)
    print(f"check_invariance: {a.model} ({a.dtype}), TP {a.tp} x batch {a.batch}, {a.prompts} prompts, "
          f"{a.new_tokens} new tokens, paths {a.paths}", flush=True)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        if dist.get_world_size() < world:
            raise SystemExit(f"error: --tp {max(a.tp)} needs at least {world} ranks, "
                             f"torchrun started {dist.get_world_size()}")
        torch.set_num_threads(1)
        runs = rank_main(dist.get_rank(), dist.get_world_size(), a)
        dist.destroy_process_group()
        if runs is None:
            return 0
    else:
        from tpinv.testing import run_ranks
        runs = run_ranks(rank_main, world, a, timeout=3600)[0]
    return 0 if report(a, runs) else 1


if __name__ == "__main__":
    sys.exit(main())
