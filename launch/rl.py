"""True on-policy RL: GRPO on arithmetic, engine rollouts at one TP size, the trainer at another.

``python launch/rl.py`` spawns gloo ranks on the CPU (as many as the larger TP size: 1, 2 or 4;
a TP size of n runs on ranks 0..n-1; ``--backend nccl`` puts rank r on GPU r) and runs, from
one supervised warm start of a tiny Qwen3-shaped model (one-digit addition, ``"3+5=8\\n"``):

* the tpinv run: the engine samples a group of answers per prompt at ``--rollout-tp`` (default
  2), the trainer scores them and takes a GRPO step at ``--trainer-tp`` (default 1), and the
  trainer's weights are copied into the engine's shards in place after every step (one engine
  serves every step: its KV cache and, with ``--cuda-graph``, its captured decode graph read
  the new weights where the old ones were);
* the vanilla run: the same loop through the plain forward (BLAS, SDPA, ``torch.log_softmax``,
  plain ``all_reduce``) on both sides.

Each step logs the mean reward, the K3 KL(rollout || trainer), NeMo-RL's token_mult_prob_error
and the fraction of tokens whose two log-probs are the same bits.  The invariant run gives KL
exactly 0 and token_mult_prob_error exactly 1.0 at every step; the vanilla run does not.
``metrics.jsonl`` and ``rl_curves.png`` go to ``--out``.  Swap the sizes with
``--rollout-tp 1 --trainer-tp 2``; ``--rollout-tp 4 --trainer-tp 1`` is the layout of an RL
job whose inference engine runs at TP=4.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpinv.core.contract import DEFAULT_LEAVES, InvarianceError
from tpinv.engine import Engine, Request, SamplingParams
from tpinv.engine.metrics import mismatch_metrics
from tpinv.models import Transformer, get_config
from tpinv.models.args import check_model_sizes
from tpinv.rl.mismatch import correct, importance_weights
from tpinv.rl.grpo import (arithmetic_prompt, arithmetic_reward, full_weights, group_advantages, policy_loss,
                           sequence_log_probs, sync_weights)
from tpinv.training.data import ArithmeticTask
from tpinv.training.optim import InvariantAdamW, ParamLayout, TorchAdamW


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--rollout-tp", type=int, default=2, choices=(1, 2, 4))
    p.add_argument("--trainer-tp", type=int, default=1, choices=(1, 2, 4))
    p.add_argument("--steps", type=int, default=40, help="GRPO steps per run")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--pool", type=int, default=16, help="distinct problems the prompts cycle through")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sft-steps", type=int, default=60, help="supervised warm-start steps")
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--correction", default="none", choices=("none", "tis", "mis"),
                   help="mismatch correction of the loss (tpinv.rl.mismatch): token-level TIS (cap 2) or "
                        "MIS (drop tokens with weight outside [0.5, 2]); the identity on the invariant path")
    p.add_argument("--runs", default="tpinv,vanilla", help="comma-separated: tpinv, vanilla")
    p.add_argument("--out", default="rl_out")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                   help="gloo: every rank on the CPU; nccl: rank r on GPU r")
    p.add_argument("--cuda-graph", action="store_true",
                   help="with --backend nccl: the engine replays its decode steps from CUDA graphs")
    args = p.parse_args(argv)
    world = max(args.rollout_tp, args.trainer_tp)
    if args.backend == "nccl" and torch.cuda.device_count() < world:
        p.error(f"--backend nccl runs {world} ranks on {world} GPUs; {torch.cuda.device_count()} visible")
    if args.cuda_graph and args.backend != "nccl":
        p.error("--cuda-graph needs --backend nccl (CUDA graphs run on GPUs)")
    if args.rollout_tp == args.trainer_tp:
        p.error("use different TP sizes for the engine and the trainer (e.g. --rollout-tp 2 --trainer-tp 1)")
    try:
        cfg = get_config(args.model)
    except KeyError as e:
        p.error(str(e.args[0]))
    for flag, tp in (("--rollout-tp", args.rollout_tp), ("--trainer-tp", args.trainer_tp)):
        try:
            check_model_sizes(cfg, tp, DEFAULT_LEAVES)
        except InvarianceError as e:
            p.error(f"{flag} {tp}: {e}")
    return args


def warm_start(model, args, device) -> None:
    """Supervised steps on one-digit addition (tpinv's loss, the same weights for both runs)."""
    task = ArithmeticTask(seq_len=8, seed=args.seed, digits=1, heldout_size=10)
    layout = ParamLayout(model, model.tp_size)
    opt = InvariantAdamW(layout)
    for step in range(args.sft_steps):
        batch = task.batch(step * 32, 32)
        mask = batch.loss_mask.to(device)
        loss = (model.loss(batch.tokens.to(device), batch.targets.to(device)) * mask).sum() / batch.num_loss_tokens
        loss.backward()
        grads = layout.flatten_grads(torch.empty(layout.numel, device=device))
        model.zero_grad(set_to_none=True)
        opt.step(grads, args.sft_lr)


def rl_run(rank: int, world: int, args, vanilla: bool, log, device: torch.device) -> list[dict]:
    solo = [dist.new_group([r]) for r in range(world)][rank]  # a TP=1 group of this rank alone
    # TP size n runs on ranks 0..n-1 (every rank creates every group, in the same order)
    groups = {n: dist.new_group(list(range(n))) if n > 1 else solo
              for n in sorted({args.trainer_tp, args.rollout_tp})}
    trainer_group, engine_group = groups[args.trainer_tp], groups[args.rollout_tp]
    cfg = get_config(args.model, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    torch.manual_seed(args.seed)  # seeded init: the same full weights at every TP size
    policy = Transformer(cfg, tp_group=trainer_group).to(device) if rank < args.trainer_tp else None
    engine_model = Transformer(cfg, tp_group=engine_group).to(device) if rank < args.rollout_tp else None
    specs = {n: (tuple(p.shape), p.dtype) for n, p in Transformer(cfg, tp_group=solo).named_parameters()}
    if policy is not None:
        warm_start(policy, args, device)
        layout = ParamLayout(policy, policy.tp_size)
        opt = (TorchAdamW if vanilla else InvariantAdamW)(layout)
    task = ArithmeticTask(seq_len=8, seed=args.seed, digits=1, heldout_size=10)

    def sync():
        full = full_weights(policy, trainer_group) if policy is not None else None
        sync_weights(full if rank == 0 else None, engine_model, specs, device=device)

    sync()
    # one engine for the run: each step's weights are copied into engine_model's parameters in place
    engine = None if engine_model is None else Engine(
        engine_model, max_batch=args.prompts * args.group, max_context=16, vanilla=vanilla,
        cuda_graph=args.cuda_graph and not vanilla)
    history = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        pairs = [task.pair((step * args.prompts + i) % args.pool) for i in range(args.prompts)]
        prompts = [arithmetic_prompt(a, b) for a, b in pairs for _ in range(args.group)]
        payload = [None]
        if engine is not None:
            sampling = SamplingParams(1.0, seed=args.seed * 1000 + step)
            reqs = [Request(f"{step}-{i}", p, max_tokens=3, sampling=sampling, stop_token_ids=[10], ignore_eos=True)
                    for i, p in enumerate(prompts)]
            payload = [[(r.token_ids, r.logprobs.cpu()) for r in engine.generate(reqs)]]
        dist.broadcast_object_list(payload, src=0)
        gens = [g for g, _ in payload[0]]
        rollout_lp = torch.zeros(len(gens), max(len(g) for g in gens))
        for i, (_, lp) in enumerate(payload[0]):
            rollout_lp[i, :len(lp)] = lp
        rollout_lp = rollout_lp.to(device)
        rewards = torch.tensor([arithmetic_reward(a, b, g) for (a, b), g in
                                zip([p for p in pairs for _ in range(args.group)], gens)])
        rec = {"run": "vanilla" if vanilla else "tpinv", "step": step + 1, "reward": float(rewards.mean())}
        if policy is not None:
            train_lp, mask = sequence_log_probs(policy, prompts, gens, vanilla=vanilla)
            m = mismatch_metrics(rollout_lp[mask], train_lp.detach()[mask])
            rec.update(k3_kl=m["k3_kl"], token_mult_prob_error=m["token_mult_prob_error"],
                       frac_bitwise_equal=m["fraction_bitwise_equal"], max_abs_diff=m["max_abs_logprob_diff"])
            w = importance_weights(train_lp.detach(), rollout_lp, mask)
            rec.update(is_weight_min=float(w[mask].min()), is_weight_max=float(w[mask].max()))
            weights, loss_mask = None, mask
            if args.correction != "none":
                weights, loss_mask = correct(train_lp.detach(), rollout_lp, mask,
                                             mode="truncate" if args.correction == "tis" else "mask")
            adv = group_advantages(rewards.view(args.prompts, args.group)).reshape(-1).to(device)
            loss = policy_loss(train_lp, rollout_lp, adv, loss_mask.float(), weights=weights)
            loss.backward()
            grads = layout.flatten_grads(torch.empty(layout.numel, device=device))
            policy.zero_grad(set_to_none=True)
            opt.step(grads, args.lr)
        sync()
        rec["time_s"] = round(time.perf_counter() - t0, 2)
        if rank == 0:
            log(rec)
        history.append(rec)
    if engine is not None:
        engine.close()
    return history


def plot(history: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    keys = [("reward", "mean reward"), ("k3_kl", "K3 KL(rollout || trainer)"),
            ("token_mult_prob_error", "token_mult_prob_error"), ("frac_bitwise_equal", "bitwise-equal log-probs")]
    for ax, (key, label) in zip(axes, keys):
        for run, style in (("tpinv", "o-"), ("vanilla", "s--")):
            pts = [(r["step"], r[key]) for r in history if r["run"] == run and key in r]
            if pts:
                ax.plot(*zip(*pts), style, label=run, markersize=3)
        ax.set_title(label)
        ax.set_xlabel("GRPO step")
        ax.legend()
    axes[1].set_yscale("symlog", linthresh=1e-9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    history = []
    path = os.path.join(args.out, "metrics.jsonl")

    def log(rec):
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        extra = (f" KL={rec['k3_kl']:.3e} tmpe={rec['token_mult_prob_error']:.9f} "
                 f"bitwise={rec['frac_bitwise_equal']:.3f} "
                 f"IS weights [{rec['is_weight_min']:.6f}, {rec['is_weight_max']:.6f}]") if "k3_kl" in rec else ""
        print(f"[{rec['run']:7s}] step {rec['step']:3d} reward={rec['reward']:.3f}{extra} ({rec['time_s']}s)",
              flush=True)

    for run in args.runs.split(","):
        history += rl_run(rank, world, args, run == "vanilla", log, device)
    if rank == 0:
        if not any("k3_kl" in r for r in history):  # the trainer lives on rank 0 in every layout
            raise RuntimeError("no trainer metrics were logged")
        plot(history, os.path.join(args.out, "rl_curves.png"),
             f"GRPO, {args.model}: rollout TP={args.rollout_tp}, trainer TP={args.trainer_tp}")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, "metrics.jsonl"), "w").close()
    world = max(args.rollout_tp, args.trainer_tp)
    mp.spawn(worker, args=(world, free_port(), args), nprocs=world, join=True)
    with open(os.path.join(args.out, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f]
    tp = [r for r in history if r["run"] == "tpinv"]
    ok = all(r["k3_kl"] == 0.0 and r["token_mult_prob_error"] == 1.0 and r["frac_bitwise_equal"] == 1.0
             and r["is_weight_min"] == r["is_weight_max"] == 1.0 for r in tp)
    if tp:
        print(f"tpinv: KL exactly 0, token_mult_prob_error and every importance weight exactly 1.0 at every "
              f"step: {ok}; reward "
              f"{tp[0]['reward']:.3f} -> {tp[-1]['reward']:.3f}")
    van = [r for r in history if r["run"] == "vanilla"]
    if van:
        print(f"vanilla: K3 KL {van[0]['k3_kl']:.3e} -> {van[-1]['k3_kl']:.3e}, token_mult_prob_error "
              f"{van[0]['token_mult_prob_error']:.9f} -> {van[-1]['token_mult_prob_error']:.9f}; reward "
              f"{van[0]['reward']:.3f} -> {van[-1]['reward']:.3f}")
    print(f"wrote {os.path.join(args.out, 'metrics.jsonl')} and rl_curves.png")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
