"""Host synchronizations of one eager training step at TP=N on N GPUs (NCCL), counted per rank.

Run with ``torchrun --nproc-per-node N tools/gpu_sync_count.py [--model qwen3-tiny] --json out.json``.
Each rank builds the model at TP=N, runs one step (forward, loss, backward) to warm every cache
(the tree reducer checks its call signature across ranks once), then runs the same step under
``torch.cuda.set_sync_debug_mode("warn")``: every call that makes the host wait for the device
warns, and the warnings are counted with the source line that made them.  The control step adds
one ``loss.item()`` and must count exactly one more, so the count is known to see a host read.
Rank 0 prints a line per rank; ``--json`` writes ``{"world", "model", "device", "ranks": [{"syncs",
"where", "control_syncs", "control_where"}, ...]}``.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from tpinv.models import Transformer, get_config
from tpinv.testing.syncs import training_step_syncs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("counts CUDA host synchronizations: needs CUDA devices")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = Transformer(get_config(opts.model, dtype=torch.bfloat16), tp_group=group).to(device)
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, model.args.vocab_size, (opts.batch, opts.seq), generator=gen).to(device)
    targets = torch.randint(0, model.args.vocab_size, (opts.batch, opts.seq), generator=gen).to(device)
    where, control = training_step_syncs(model, tokens, targets)
    rows = [None] * world
    dist.all_gather_object(rows, {"syncs": len(where), "where": where,
                                  "control_syncs": len(control), "control_where": control})
    if rank == 0:
        for r, row in enumerate(rows):
            print(f"rank {r}: {row['syncs']} host synchronization(s) a step {row['where']}; "
                  f"control (one loss.item() more): {row['control_syncs']}")
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump({"world": world, "model": opts.model, "device": torch.cuda.get_device_name(),
                           "ranks": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
