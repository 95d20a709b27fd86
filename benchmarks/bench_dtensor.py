"""Time the three DTensor TP plans on one HF model and count the bytes they communicate.

For each plan of :mod:`tpinv.dtensor` (``invariant``, ``numerically_stable``, ``default``)
the same HF model (same seed) is sharded over the TP group and one training step is timed:
forward (logits and per-token loss) and backward separately, median over ``--iters`` after
a warm-up, each timing the slowest rank's after a barrier.  One more step runs under a
dispatch mode that records every collective (c10d and functional collectives): calls and
bytes per rank, in the ring model (all-reduce ``2(C-1)/C * n``, all-gather ``(C-1) * n_in``,
reduce-scatter and all-to-all ``(C-1)/C * n_in``).  ``bits`` digests the logits and the loss
(:func:`tpinv.testing.bits`): the invariant plan prints the same digest at every ``--tp``.

    python -m benchmarks.bench_dtensor --tp 2 --json dtensor.json          # spawns gloo ranks on CPU
    python -m benchmarks.bench_dtensor --tp 4 --family qwen3 --seq 128 --dtype bf16
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import write_json
from tpinv.dtensor import PLANS, cross_entropy, parallelize
from tpinv.core.dtypes import dtype_from_name
from tpinv.testing import bits

FAMILIES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM")}
#: Ring-model bytes sent per rank, as a factor of the input bytes, for a group of ``c`` ranks.
_WIRE = {"all_reduce": lambda c: 2 * (c - 1) / c, "all_gather": lambda c: c - 1,
         "reduce_scatter": lambda c: (c - 1) / c, "all_to_all": lambda c: (c - 1) / c}
_KINDS = (("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("allgather", "all_gather"),
          ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
          ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"))
_INPUT_ARGS = ("input_tensor", "input_tensors", "inputs", "input", "tensors")


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CollectiveLog(TorchDispatchMode):
    """Counts collectives (calls, input bytes, ring-model bytes sent) over a group of ``size``."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self.calls: dict[str, int] = defaultdict(int)
        self.wire = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, name = func._schema.name.partition("::")
        kind = next((k for key, k in _KINDS if key in name), None) if "c10d" in namespace else None
        if kind is not None:
            bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
            arg = next(n for n in _INPUT_ARGS if n in bound)
            self.calls[kind] += 1
            self.wire += _WIRE[kind](self.size) * _nbytes(bound[arg])
        return func(*args, **kwargs)

    def summary(self) -> dict:
        return {"calls": dict(self.calls), "total_calls": sum(self.calls.values()),
                "MB_sent": self.wire / 2**20}


def build(args: argparse.Namespace):
    import transformers
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[args.family])
    extra = {"head_dim": args.hidden // args.heads, "tie_word_embeddings": args.family == "qwen3"}
    if args.family == "mistral":
        extra["sliding_window"] = args.seq // 2
    config = config_cls(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, max_position_embeddings=4 * args.seq,
                        attn_implementation="eager", **extra)
    torch.manual_seed(0)
    return model_cls(config).to(dtype_from_name(args.dtype))


def _loss(plan: str, logits, targets):
    if plan == "invariant":
        return cross_entropy(logits, targets)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


def _slowest_median(times: list[float]) -> float:
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def bench_plan(plan: str, args: argparse.Namespace, mesh) -> dict:
    model = parallelize(build(args), mesh, plan)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)

    def forward():
        logits = model(tokens, use_cache=False).logits
        return logits, _loss(plan, logits, targets)

    fwd, bwd = [], []
    for i in range(args.warmup + args.iters):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        logits, loss = forward()
        middle = time.perf_counter()
        loss.sum().backward()
        end = time.perf_counter()
        if i >= args.warmup:
            fwd.append(middle - start)
            bwd.append(end - middle)
    model.zero_grad(set_to_none=True)
    with CollectiveLog(mesh.size()) as fwd_log:
        logits, loss = forward()
    with CollectiveLog(mesh.size()) as bwd_log:
        loss.sum().backward()
    full = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"plan": plan, "forward_ms": 1e3 * _slowest_median(fwd), "backward_ms": 1e3 * _slowest_median(bwd),
            "forward_comm": fwd_log.summary(), "backward_comm": bwd_log.summary(),
            "logits_bits": bits(full.detach()), "loss_bits": bits(loss.detach())}


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    mesh = init_device_mesh("cpu", (world,))
    return [bench_plan(plan, args, mesh) for plan in args.plans]


def format_table(records: list[dict], args: argparse.Namespace) -> str:
    head = (f"{'plan':>19} {'fwd ms':>9} {'bwd ms':>9} {'fwd calls':>9} {'fwd MB':>8} "
            f"{'bwd calls':>9} {'bwd MB':>8} {'logits bits':>17} {'loss bits':>17}")
    title = (f"{args.family} {args.dtype} TP={args.tp}: hidden {args.hidden}, intermediate "
             f"{args.intermediate}, {args.layers} layers, vocab {args.vocab}, tokens {args.batch}x{args.seq}")
    lines = [title, head, "-" * len(head)]
    for r in records:
        f, b = r["forward_comm"], r["backward_comm"]
        lines.append(f"{r['plan']:>19} {r['forward_ms']:>9.1f} {r['backward_ms']:>9.1f} "
                     f"{f['total_calls']:>9} {f['MB_sent']:>8.3f} {b['total_calls']:>9} {b['MB_sent']:>8.3f} "
                     f"{r['logits_bits']:>17} {r['loss_bits']:>17}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="ranks to spawn (gloo, CPU)")
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    p.add_argument("--plans", default=",".join(PLANS))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None, help="write the settings and records to this path")
    args = p.parse_args(argv)
    args.plans = [s.strip() for s in args.plans.split(",") if s.strip()]
    unknown = sorted(set(args.plans) - set(PLANS))
    if unknown:
        p.error(f"unknown plans {unknown}; choose from {PLANS}")
    from tpinv.testing import run_ranks
    records = run_ranks(_rank_main, args.tp, args, timeout=3600.0, pg_timeout=600.0, threads=args.threads)[0]
    print(format_table(records, args))
    write_json(args.json, {"settings": vars(args), "records": records})


if __name__ == "__main__":
    main()
