"""The main job: train the same tiny model at TP=1 and TP=2 and show the curves are the same bits.

``python launch/train_demo.py`` runs four short trainings of a tiny Qwen3-shaped model on the
built-in arithmetic task (``"3+5=8\\n"``, held-out problems never trained on), each with
``torchrun`` on CPU/gloo:

    TP=1 and TP=2 with tpinv's invariant path, then the same two with --vanilla (plain torch/BLAS,
    torch.sum, all_reduce, torch.optim.AdamW: the control).

It then compares the per-step losses (their exact fp32 bits) and the final-weight sha256 of
each pair, prints a table and the verdict, and exits non-zero if the invariant pair differs.
About 2-4 minutes on 2 CPU cores.  Logs, metrics.jsonl and loss-curve PNGs go to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = (("TP=1", 1, False), ("TP=2", 2, False), ("TP=1 vanilla", 1, True), ("TP=2 vanilla", 2, True))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--digits", type=int, default=1, help="digits per operand of the arithmetic task")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="directory for logs (default: a new temporary directory)")
    return p.parse_args(argv)


def _pretrain_flags(tp: int, vanilla: bool, args, log_dir: str) -> list[str]:
    """``launch/pretrain.py``'s flags for one run of the demo."""
    seq_len = 3 * args.digits + 3
    flags = ["--tp", str(tp), "--model", args.model, "--steps", str(args.steps),
             "--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch),
             "--seq-len", str(seq_len), "--digits", str(args.digits), "--lr", str(args.lr),
             "--warmup", str(max(1, args.steps // 10)), "--eval-every", str(args.eval_every),
             "--seed", str(args.seed), "--threads", "1", "--log-dir", log_dir, "--no-progress"]
    return flags + (["--vanilla"] if vanilla else [])


def check_settings(args) -> None:
    """Refuse, before any run starts, what ``launch/pretrain.py`` would refuse in any of the four
    runs: its own checks of the settings and of the model at each TP size."""
    from tpinv.io.loading import check_source
    from tpinv.training.config import parse_configs
    for _, tp, vanilla in RUNS:
        config, _ = parse_configs(_pretrain_flags(tp, vanilla, args, "unused"))
        config.check_numbers()
        config.check(1)          # DP=1: each run's world is its TP size
        check_source(args.model, (tp,), config.leaves)
    from tpinv.training.data import make_dataset
    make_dataset(config.data, config.seq_len, config.seed, digits=config.digits,   # the same task in all four
                 heldout_size=config.heldout_size)


def _run(name: str, tp: int, vanilla: bool, args, out: str) -> dict:
    log_dir = os.path.join(out, name.replace("=", "").replace(" ", "-").lower())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
           os.path.join(HERE, "pretrain.py")] + _pretrain_flags(tp, vanilla, args, log_dir)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"\n== {name}: {' '.join(cmd[1:3])} --nproc-per-node={tp} launch/pretrain.py --tp {tp}"
          f"{' --vanilla' if vanilla else ''} ...", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(("tpinv pretrain", "final weights", "error:")) or "heldout" in line:
            print("  " + line.rstrip(), flush=True)
    proc.wait()
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        sys.stdout.write("".join(lines[-30:]))
        raise SystemExit(f"{name} failed with exit code {proc.returncode}")
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if r["event"] == "step"]
    final = next(r for r in records if r["event"] == "final")
    evals = [r for r in steps if "heldout_exact" in r]
    return {"name": name, "steps": steps, "sha": final["weights_sha256"], "time": elapsed, "log_dir": log_dir,
            "first_acc": evals[0]["heldout_exact"] if evals else None,
            "acc": evals[-1]["heldout_exact"] if evals else None}


def _first_difference(a: dict, b: dict):
    for ra, rb in zip(a["steps"], b["steps"]):
        if ra["loss_hex"] != rb["loss_hex"] or ra["grad_norm_hex"] != rb["grad_norm_hex"]:
            return ra, rb
    return None


def _table(results: list[dict]) -> str:
    head = f"{'run':<14}{'steps':>6}{'loss@1':>11}{'final loss':>12}{'final loss (hex)':>18}" \
           f"{'held-out':>16}{'weights sha256':>17}{'time':>8}"
    rows = [head, "-" * len(head)]
    for r in results:
        s = r["steps"]
        acc = "-" if r["acc"] is None else f"{100 * r['first_acc']:.0f}% -> {100 * r['acc']:.0f}%"
        rows.append(f"{r['name']:<14}{len(s):>6}{s[0]['loss']:>11.6f}{s[-1]['loss']:>12.6f}"
                    f"{s[-1]['loss_hex']:>18}{acc:>16}{r['sha'][:12] + '...':>17}{r['time']:>7.0f}s")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_settings(args)
    except (ValueError, OSError, NotImplementedError) as e:
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        return 1
    out = args.out or tempfile.mkdtemp(prefix="tpinv-train-demo-")
    os.makedirs(out, exist_ok=True)
    print(f"tpinv training demo: {args.model} on {args.digits}-digit addition, {args.steps} steps, "
          f"global batch {args.global_batch}; logs in {out}")
    start = time.monotonic()
    results = [_run(name, tp, vanilla, args, out) for name, tp, vanilla in RUNS]
    inv1, inv2, van1, van2 = results
    print("\n" + _table(results))
    print(f"\nloss curves: {', '.join(os.path.join(r['log_dir'], 'loss_curve.png') for r in results[:2])}")
    ok = True
    diff = _first_difference(inv1, inv2)
    if diff is None and inv1["sha"] == inv2["sha"] and len(inv1["steps"]) == len(inv2["steps"]):
        print(f"\nTP=1 and TP=2 loss curves and final weights are bitwise identical "
              f"({len(inv1['steps'])} steps; sha256 {inv1['sha']})")
    else:
        ok = False
        where = f"at step {diff[0]['step']} ({diff[0]['loss_hex']} vs {diff[1]['loss_hex']})" if diff else \
            "in the final weights"
        print(f"\nFAILED: the invariant TP=1 and TP=2 runs differ {where}")
    vdiff = _first_difference(van1, van2)
    if vdiff is not None:
        print(f"vanilla: TP=1 and TP=2 differ at step {vdiff[0]['step']} (loss {vdiff[0]['loss_hex']} vs "
              f"{vdiff[1]['loss_hex']}, grad norm {vdiff[0]['grad_norm_hex']} vs {vdiff[1]['grad_norm_hex']}); "
              f"final weights {'differ' if van1['sha'] != van2['sha'] else 'agree'}")
    else:
        print("vanilla: TP=1 and TP=2 happened to agree on every step"
              + ("" if van1["sha"] == van2["sha"] else ", but their final weights differ"))
    print(f"total {time.monotonic() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
