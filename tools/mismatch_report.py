"""Rollout-vs-trainer mismatch report: the metrics RL users watch, invariant vs vanilla.

    python tools/mismatch_report.py --model qwen3-tiny --tp 1,2,4 --batch 1,3,8 --trainer-tp 1 --vanilla
    torchrun --nproc-per-node 4 tools/mismatch_report.py --model CKPT_DIR --tp 1,2,4 --batch 1,3,8

For every (engine TP a, batch b) of the grid the engine generates rollouts for the same
prompts (requests in random cache slots, arriving at random steps); the training forward
(:meth:`tpinv.models.Transformer.log_probs`: full sequence, no cache) at each TP c of
``--trainer-tp`` recomputes the log-probs of the same tokens.  Reported (definitions and
sources in :mod:`tpinv.engine.metrics`): NeMo-RL's token_mult_prob_error, slime's K3 KL, the
maximum absolute log-prob difference and the fraction of bitwise-equal tokens per
(a, b, c); across the grid, the TBIK paper's count of unique outputs per prompt and maximum
probability divergence.  ``--vanilla`` adds the same run through the plain torch/BLAS/SDPA/
all_reduce control.  Prints a table, writes ``report.json`` and ``mismatch_hist.png`` (per-token
probability differences ``exp(gen_lp) - exp(train_lp)``, invariant vs vanilla, like the TBIK
paper's Figure 9) into ``--out-dir``.  Without torchrun it spawns gloo ranks itself (CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import torch

from tpinv.core.dtypes import CLI_CHOICES, cli_dtype



def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="named config, tpinv checkpoint dir or HF model dir")
    p.add_argument("--dtype", choices=CLI_CHOICES, default="keep")
    p.add_argument("--init-seed", type=int, default=0, help="weights of a named config")
    p.add_argument("--weight-scale", type=float, default=1.0,
                   help="multiply a named config's random projection/embedding weights (peakier distributions)")
    p.add_argument("--tp", type=ints, default=[1, 2, 4], help="engine TP sizes, e.g. 1,2,4")
    p.add_argument("--batch", type=ints, default=[1, 3, 8], help="engine batch sizes (cache slots), e.g. 1,3,8")
    p.add_argument("--trainer-tp", type=ints, default=[1], help="trainer TP sizes")
    p.add_argument("--vanilla", action="store_true", help="also run the vanilla control")
    p.add_argument("--prompts", help="jsonl of requests (as launch/generate.py reads; each is run with "
                   "top_logprobs=5 and ignore_eos, for the metrics); default: random prompts")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=ints, default=[4, 24], help="min,max length of random prompts")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=42, help="sampling seed (and the schedule's)")
    p.add_argument("--out-dir", default="mismatch_report")
    return p


def make_requests(args, model_args):
    """The report's requests (each with ``top_logprobs=5`` and ``ignore_eos``, for the metrics):
    ``--prompts``' lines, every one checked against the model before any rank starts (a bad line
    is refused naming its line of the file), or random prompts."""
    import dataclasses

    from tpinv.engine import Request, SamplingParams
    from tpinv.engine.scheduler import read_requests_jsonl, validate_request
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
                "top_p": args.top_p, "seed": args.seed}
    if args.prompts:
        reqs = []
        for line in read_requests_jsonl(args.prompts, defaults):
            try:
                if line.request is None:
                    raise ValueError(line.error)
                reqs.append(dataclasses.replace(line.request, top_logprobs=5, ignore_eos=True))
                validate_request(reqs[-1], vocab_size=model_args.vocab_size,
                                 max_context=model_args.max_position_embeddings)   # no tokenizer: token ids
            except (ValueError, TypeError) as e:
                where = "" if str(e).startswith(f"line {line.number}:") else f"line {line.number}: "
                raise ValueError(f"--prompts {args.prompts}: {where}{e}") from None
        return reqs
    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = args.prompt_len
    return [Request(i, torch.randint(0, model_args.vocab_size, (int(torch.randint(lo, hi + 1, (1,), generator=gen)),),
                                     generator=gen).tolist(), max_tokens=args.max_tokens, top_logprobs=5,
                    ignore_eos=True, sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed))
            for i in range(args.num_prompts)]


def build_model(spec: dict, group):
    from tpinv.io.loading import load_model
    model, tokenizer = load_model(spec["model"], tp_group=group, dtype=spec["dtype"], init_seed=spec["init_seed"])
    if spec["weight_scale"] != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.weight") or name.endswith("embed_tokens.weight"):
                    p.mul_(spec["weight_scale"])
    return model, tokenizer


def engine_rollouts(group, spec: dict, batches: Sequence[int], modes: Sequence[bool], requests) -> dict:
    """``{(vanilla, batch): [(prompt_ids, token_ids, logprobs, top-5 probs)]}`` at the TP size of ``group``."""
    from tpinv.distributed.groups import group_size
    from tpinv.engine import Engine
    tp = group_size(group)
    model, tokenizer = build_model(spec, group)
    out = {}
    for vanilla in modes:
        for b in batches:
            gen = torch.Generator().manual_seed(spec["seed"] * 1009 + 31 * tp + b)
            slots = torch.randperm(b, generator=gen).tolist()
            arrivals = torch.randint(0, 4, (len(requests),), generator=gen).tolist()
            engine = Engine(model, tokenizer=tokenizer, max_batch=b, slot_order=slots, vanilla=vanilla)
            res = engine.generate(requests, arrival_steps=arrivals)
            bad = [r.error for r in res if not r.ok]
            if bad:
                raise ValueError(f"request rejected: {bad[0]}")
            out[vanilla, b] = [(r.prompt_ids, r.token_ids, r.logprobs, r.top_logprobs.exp()) for r in res]
    return out


def trainer_scores(group, spec: dict, rollouts: dict) -> dict:
    """``{key: [train log-probs per request]}`` for ``rollouts {key: (vanilla, [(prompt, generated)])}``."""
    from tpinv.engine.metrics import trainer_log_probs
    model, _ = build_model(spec, group)
    return {key: trainer_log_probs(model, seqs, vanilla=vanilla) for key, (vanilla, seqs) in rollouts.items()}


def _spawned(rank, world, fn_name, *args):
    import torch.distributed as dist
    return globals()[fn_name](dist.group.WORLD if world > 1 else None, *args)


def run_at_sizes(fn_name: str, sizes: Sequence[int], *args) -> dict:
    """``{size: rank 0's result of fn(group of that size, *args)}``: under torchrun on ranks ``[0, size)``,
    otherwise in freshly spawned gloo ranks."""
    import torch.distributed as dist
    out = {}
    if dist.is_initialized():
        for size in sizes:
            if size > dist.get_world_size():
                raise ValueError(f"TP={size} needs at least {size} ranks; the world has {dist.get_world_size()}")
            group = dist.new_group(list(range(size)))   # every rank creates every group, in the same order
            if dist.get_rank() < size:
                result = globals()[fn_name](group, *args)
                if dist.get_rank() == 0:
                    out[size] = result
            dist.barrier()
        return out
    from tpinv.testing import run_ranks
    for size in sizes:
        out[size] = run_ranks(_spawned, size, fn_name, *args, timeout=3600)[0]
    return out


def summarize(requests, gens: dict, scores: dict, modes, tps, batches, trainer_tps) -> dict:
    from tpinv.engine.metrics import count_unique_outputs, max_probability_divergence, mismatch_metrics
    rows, grid, diffs = [], {}, {}
    for vanilla in modes:
        mode = "vanilla" if vanilla else "invariant"
        configs = [gens[tp][vanilla, b] for tp in tps for b in batches]
        unique = [count_unique_outputs([c[i][1] for c in configs]) for i in range(len(requests))]
        div = [max_probability_divergence([c[i][3] for c in configs]) for i in range(len(requests))]
        grid[mode] = {"configurations": len(configs), "unique_outputs_per_prompt": unique,
                      "avg_unique_outputs": sum(unique) / len(unique), "max_prob_divergence_per_prompt": div,
                      "avg_max_prob_divergence": sum(div) / len(div)}
        diffs[mode] = []
        for tp in tps:
            for b in batches:
                gen_lp = torch.cat([o[2] for o in gens[tp][vanilla, b]])
                for c in trainer_tps:
                    train_lp = torch.cat(scores[c][vanilla, tp, b])
                    rows.append({"mode": mode, "engine_tp": tp, "batch": b, "trainer_tp": c,
                                 **mismatch_metrics(gen_lp, train_lp)})
                    diffs[mode] += (gen_lp.double().exp() - train_lp.double().exp()).tolist()
    return {"rows": rows, "grid": grid, "prob_diffs": diffs}


def print_table(report: dict, file=sys.stdout) -> None:
    head = f"{'mode':<10}{'eng TP':>7}{'batch':>6}{'trn TP':>7}{'tokens':>7}{'mult_prob_err':>15}{'K3 KL':>12}" \
           f"{'max|dlp|':>11}{'bitwise=':>9}"
    print(head, file=file)
    for r in report["rows"]:
        print(f"{r['mode']:<10}{r['engine_tp']:>7}{r['batch']:>6}{r['trainer_tp']:>7}{r['tokens']:>7}"
              f"{r['token_mult_prob_error']:>15.9f}{r['k3_kl']:>12.3e}{r['max_abs_logprob_diff']:>11.3e}"
              f"{r['fraction_bitwise_equal']:>9.3f}", file=file)
    for mode, g in report["grid"].items():
        print(f"{mode}: across {g['configurations']} (TP x batch) configurations: avg unique outputs per prompt "
              f"{g['avg_unique_outputs']:.2f} (max {max(g['unique_outputs_per_prompt'])}), avg maximum probability "
              f"divergence {g['avg_max_prob_divergence']:.3e}", file=file)


def save_histogram(diffs: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    values = [abs(v) for d in diffs.values() for v in d]
    span = max(max(values, default=0.0), 1e-12)
    fig, axes = plt.subplots(1, len(diffs), figsize=(5 * len(diffs), 3.6), sharey=True, squeeze=False)
    for ax, (mode, d) in zip(axes[0], diffs.items()):
        ax.hist(d, bins=41, range=(-span, span), color="tab:green" if mode == "invariant" else "tab:red")
        zero = sum(1 for v in d if v == 0.0)
        ax.set_title(f"{mode}: {zero}/{len(d)} tokens identical")
        ax.set_xlabel("p_engine - p_trainer (per token)")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from tpinv.io.loading import check_source
    try:   # before any rank starts: the model at every TP size, every request line
        requests = make_requests(args, check_source(args.model, sorted(set(args.tp + args.trainer_tp))))
    except (ValueError, OSError) as e:
        parser.error(" ".join(str(e).split()))
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        import torch.distributed as dist
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    spec = {"model": args.model, "dtype": cli_dtype(args.dtype), "init_seed": args.init_seed,
            "weight_scale": args.weight_scale, "seed": args.seed}
    modes = [False, True] if args.vanilla else [False]
    gens = run_at_sizes("engine_rollouts", args.tp, spec, args.batch, modes, requests)
    rank0 = not (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0)
    rollouts = {(v, tp, b): (v, [(o[0], o[1]) for o in gens[tp][v, b]])
                for v in modes for tp in args.tp for b in args.batch} if rank0 else {}
    if torch.distributed.is_initialized():
        box = [rollouts]
        torch.distributed.broadcast_object_list(box, src=0)
        rollouts = box[0]
    scores = run_at_sizes("trainer_scores", args.trainer_tp, spec, rollouts)
    if rank0:
        report = summarize(requests, gens, scores, modes, args.tp, args.batch, args.trainer_tp)
        os.makedirs(args.out_dir, exist_ok=True)
        print_table(report)
        save_histogram(report["prob_diffs"], os.path.join(args.out_dir, "mismatch_hist.png"))
        with open(os.path.join(args.out_dir, "report.json"), "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), **report}, f, indent=1)
        print(f"wrote {args.out_dir}/report.json and {args.out_dir}/mismatch_hist.png")
    if torch.distributed.is_initialized():  # no rank exits while another's gloo threads still run
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
