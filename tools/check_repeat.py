#!/usr/bin/env python3
"""Run the same eager training step several times and report which tensors' bytes vary.

A kernel that races (two programs sharing memory without the ordering they need) can give a
different result on some calls only, and still pass every check that compares two calls which
happened to agree.  This tool builds a model from a named config (random weights, seed 0),
runs ``--steps`` identical training steps on fixed random tokens (``zero_grad``, loss,
backward), hashes the loss and every parameter's gradient each time, and prints, per tensor
whose bytes took more than one value, how many distinct values it took.  Exits 1 if any did.

    python tools/check_repeat.py --model qwen3-0.6b --layers 2 --kv-heads 16 --batch 3 --seq 77

Defaults are a CPU smoke run (``qwen3-tiny``, seconds); the command above is a GPU one (on a
CPU a step of that shape takes minutes).  On CUDA the shapes worth trying are the ones that
leave ragged tiles: one query head per kv head (``--kv-heads`` = the heads), sequence lengths
that are not a multiple of 64, several batch rows.  ``--json`` writes the counts.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch

from tpinv.core.dtypes import dtype_from_name
from tpinv.models import Transformer, get_config
from tpinv.testing.bits import bits


def repeated_step_digests(model, tokens: torch.Tensor, targets: torch.Tensor,
                          steps: int, progress=None) -> dict[str, set[str]]:
    """``{tensor name: distinct digests}`` over ``steps`` identical training steps; ``progress``
    (a text stream) gets a line after each step."""
    if steps < 2:
        raise ValueError(f"steps must be at least 2 to compare anything, got {steps}")
    seen: dict[str, set[str]] = defaultdict(set)
    start = time.perf_counter()
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model.loss(tokens, targets)
        loss.sum().backward()
        seen["loss"].add(bits(loss))
        for name, p in model.named_parameters():
            if p.grad is not None:
                seen[f"grad {name}"].add(bits(p.grad))
        if progress is not None:
            print(f"  step {step + 1}/{steps} done ({time.perf_counter() - start:.1f} s)", file=progress, flush=True)
    return dict(seen)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-tiny", help="named config")
    p.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    p.add_argument("--kv-heads", type=int, default=None, help="override the config's kv heads")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=33)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    overrides = {"dtype": dtype_from_name(opts.dtype)}
    if opts.layers is not None:
        overrides["num_layers"] = opts.layers
    if opts.kv_heads is not None:
        overrides["num_kv_heads"] = opts.kv_heads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Transformer(get_config(opts.model, **overrides)).to(device)
    gen = torch.Generator().manual_seed(1)
    shape = (opts.batch, opts.seq)
    tokens = torch.randint(0, model.args.vocab_size, shape, generator=gen).to(device)
    targets = torch.randint(0, model.args.vocab_size, shape, generator=gen).to(device)
    print(f"check_repeat: {opts.model} on {device}, {opts.steps} steps of {opts.batch} x {opts.seq} tokens",
          file=sys.stderr, flush=True)
    seen = repeated_step_digests(model, tokens, targets, opts.steps, progress=sys.stderr)
    varying = {name: len(d) for name, d in seen.items() if len(d) > 1}
    print(f"{opts.model} on {device} ({model.args.num_heads} heads, {model.args.num_kv_heads} kv heads, "
          f"{model.args.num_layers} layers), {opts.batch} x {opts.seq} tokens, {opts.steps} steps: "
          f"{len(seen)} tensors, {len(varying)} varying")
    for name, count in sorted(varying.items()):
        print(f"  {name}: {count} distinct results in {opts.steps} steps")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"model": opts.model, "device": str(device), "batch": opts.batch, "seq": opts.seq,
                       "steps": opts.steps, "tensors": len(seen), "varying": varying}, f, indent=1)
    return 1 if varying else 0


if __name__ == "__main__":
    sys.exit(main())
