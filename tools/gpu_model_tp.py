"""The decoder at TP=1 and TP=N on N GPUs (NCCL; N = 2, 4 or 8): the same logits, loss and
gradients, bit for bit.

Run with ``torchrun --nproc-per-node N tools/gpu_model_tp.py [--models qwen3-tiny,qwen3-0.6b:24]``.
Each rank builds the model at TP=1 in a group of its own (one GPU each) and then at TP=N
(all the GPUs) from the same seed; rank 0 compares the gathered logits, the per-token loss
(``model.loss``) and every parameter gradient gathered to its full tensor, and checks the
negative control: the plain-torch path (:func:`tpinv.models.vanilla.vanilla_forward`,
cuBLAS and a plain all-reduce) gives different logits at TP=1 and TP=N.  It also times a
forward+backward of both paths; with ``--engine`` it also compares the engine's generations
(token ids and log-probs; on CUDA every decode step replayed from a CUDA graph, NCCL
collectives inside) at TP=1 and TP=N.  A model with fewer kv heads than N holds each kv head
on several ranks; its gradients are gathered with one copy of each.  Prints a table;
``--json`` writes the results.
Without CUDA it runs on CPU with gloo (a check of the script itself).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from tpinv.models import Transformer, get_config
from tpinv.models.vanilla import vanilla_forward, vanilla_loss
from tpinv.distributed.reduce import gather_shards
from tpinv.testing import same_bits


def parse_models(text: str) -> list[tuple[str, int | None]]:
    """``"qwen3-tiny,qwen3-0.6b:24"`` -> ``[("qwen3-tiny", None), ("qwen3-0.6b", 24)]`` (layers)."""
    out = []
    for item in text.split(","):
        name, _, layers = item.partition(":")
        out.append((name, int(layers) if layers else None))
    return out


def build(name: str, layers: int | None, dtype: torch.dtype, group, device) -> Transformer:
    """The model from seed 0 (weights drawn on the CPU, then sharded), moved to ``device``."""
    overrides = {"dtype": dtype} if layers is None else {"dtype": dtype, "num_layers": layers}
    args = get_config(name, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Transformer(args, tp_group=group)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():   # non-unit norm weights and larger projections: differences show
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):      # replicated: the same draw on every rank
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("proj.weight"):
                p.mul_(3.0)
    return model.to(device)


def full_tensor(t: torch.Tensor, p: torch.nn.Parameter, group, tp: int) -> torch.Tensor:
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return t.detach().clone()
    return gather_shards(t, group, p.partition_dim, getattr(p, "tpinv_replicas", 1))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run_case(name, layers, group, tp, device, batch, seq, iters, engine=False):
    model = build(name, layers, torch.bfloat16, group, device)
    vocab = model.args.vocab_size
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    weights = torch.rand(batch, seq, generator=gen).to(device)   # a non-uniform d(loss) per token
    with torch.no_grad():
        logits = model(tokens, gather_logits=True)
        vanilla = vanilla_forward(model, tokens, gather_logits=True)
    loss = model.loss(tokens, targets)
    loss.backward(weights)
    grads = {n: full_tensor(p.grad, p, group, tp) for n, p in model.named_parameters()}

    def step_tpinv():
        model.zero_grad(set_to_none=True)
        model.loss(tokens, targets).backward(weights)

    def step_vanilla():
        model.zero_grad(set_to_none=True)
        vanilla_loss(model, tokens, targets).backward(weights)

    t_tpinv = timed(step_tpinv, device, iters)
    t_vanilla = timed(step_vanilla, device, iters)
    params = sum(g.numel() for g in grads.values())
    model.zero_grad(set_to_none=True)
    generated, replays = generate(model, device) if engine else (None, 0)
    del model
    return {"logits": logits, "vanilla": vanilla, "loss": loss.detach(), "grads": grads,
            "t_tpinv": t_tpinv, "t_vanilla": t_vanilla, "params": params,
            "generated": generated, "decode_replays": replays}


def generate(model, device) -> tuple[list, int]:
    """Token ids and log-probs of a few requests joining mid-flight (greedy and sampled), from
    the engine -- each decode step replayed from a CUDA graph on CUDA -- and the replay count."""
    from tpinv.engine import Engine, Request, SamplingParams
    gen = torch.Generator().manual_seed(3)
    reqs = [Request(f"r{i}", torch.randint(0, model.args.vocab_size, (n,), generator=gen).tolist(),
                    max_tokens=6, sampling=SamplingParams(0.0) if i % 2 else SamplingParams(0.8, seed=i))
            for i, n in enumerate((5, 19, 11, 30))]
    engine = Engine(model, max_batch=3, max_context=64, cuda_graph=device.type == "cuda")
    results = engine.generate(reqs, arrival_steps=[0, 1, 1, 3])
    replays = engine.decode_graph.replays if engine.decode_graph is not None else 0
    engine.close()   # free the captured graph (it holds NCCL work) before the process group goes
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [(r.token_ids, r.logprobs.cpu()) for r in results], replays


def compare(one: dict, many: dict) -> dict:
    grads_equal = sum(same_bits(one["grads"][n], g) for n, g in many["grads"].items())
    return {
        "logits_equal": same_bits(one["logits"], many["logits"]),
        "loss_equal": same_bits(one["loss"], many["loss"]),
        "grads_equal": int(grads_equal), "grads_total": len(one["grads"]),
        "grad_names_match": one["grads"].keys() == many["grads"].keys(),
        "vanilla_logits_differ": not same_bits(one["vanilla"], many["vanilla"]),
        "generated_equal": None if one["generated"] is None else all(
            a[0] == b[0] and same_bits(a[1], b[1]) for a, b in zip(one["generated"], many["generated"])),
        "decode_replays": [one["decode_replays"], many["decode_replays"]],
        "vanilla_max_abs_diff": (one["vanilla"].float() - many["vanilla"].float()).abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-tiny,qwen3-0.6b:24")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--engine", action="store_true",
                        help="also compare the engine's generations (graphed decode on CUDA)")
    opts = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world not in (2, 4, 8):
        raise SystemExit(f"run with 2, 4 or 8 ranks (torchrun --nproc-per-node N), got {world}")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    own = [dist.new_group([r]) for r in range(world)]
    every = dist.new_group(list(range(world)))

    rows = []
    for name, layers in parse_models(opts.models):
        one = run_case(name, layers, own[rank], 1, device, opts.batch, opts.seq, opts.iters, opts.engine)
        dist.barrier()
        many = run_case(name, layers, every, world, device, opts.batch, opts.seq, opts.iters, opts.engine)
        if rank == 0:
            row = {"model": name, "num_layers": layers or get_config(name).num_layers,
                   "params": many["params"], "batch": opts.batch, "seq": opts.seq,
                   **compare(one, many),
                   "tp1_fwd_bwd_s": one["t_tpinv"], f"tp{world}_fwd_bwd_s": many["t_tpinv"],
                   "tp1_vanilla_fwd_bwd_s": one["t_vanilla"], f"tp{world}_vanilla_fwd_bwd_s": many["t_vanilla"]}
            rows.append(row)
        del one, many
        dist.barrier()

    if rank == 0:
        head = (f"{'model':<12} {'layers':>6} {'params':>11} {'logits':>6} {'loss':>5} {'grads':>9} "
                f"{'vanilla differs':>15} {'tp1 s':>7} {f'tp{world} s':>7} {'van1 s':>7} {f'van{world} s':>7} "
                f"{'generated':>9} {'replays':>9}")
        print(f"device: {torch.cuda.get_device_name(device) if use_cuda else 'cpu'} x{world}, bf16")
        print(head)
        for r in rows:
            print(f"{r['model']:<12} {r['num_layers']:>6} {r['params']:>11} {str(r['logits_equal']):>6} "
                  f"{str(r['loss_equal']):>5} {r['grads_equal']:>4}/{r['grads_total']:<4} "
                  f"{str(r['vanilla_logits_differ']):>15} {r['tp1_fwd_bwd_s']:>7.3f} {r[f'tp{world}_fwd_bwd_s']:>7.3f} "
                  f"{r['tp1_vanilla_fwd_bwd_s']:>7.3f} {r[f'tp{world}_vanilla_fwd_bwd_s']:>7.3f} "
                  f"{str(r['generated_equal']):>9} {str(r['decode_replays']):>9}")
        if opts.json:
            os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
            with open(opts.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
                           "world": world, "dtype": "bfloat16", "rows": rows}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
