"""Generate from a jsonl file of prompts with the tpinv engine (a thin torchrun CLI).

    torchrun --nproc-per-node C launch/generate.py --model MODEL --input prompts.jsonl --output results.jsonl
    python launch/generate.py --model qwen3-tiny --input prompts.jsonl --output results.jsonl   # TP=1

MODEL is a named config (random weights from --init-seed), a tpinv checkpoint directory or a
HF model directory; the TP size is the number of ranks.  Each input line is a JSON object:
``{"id": ..., "prompt": "text"}`` or ``{"prompt_ids": [ids]}``, optionally ``max_tokens``,
``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``,
``top_logprobs`` (the command-line values are the defaults).  Each output line holds the
request's ``id``, ``prompt_ids``, ``token_ids``, ``text``, ``logprobs`` (raw model log-probs,
the training forward's bits), ``sampled_logprobs`` (under the distribution sampled from,
after temperature/top-k/top-p), ``finish_reason`` and ``error``, in input order.  A bad line
gets an error result; the others are generated exactly as without it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from tpinv.core.dtypes import CLI_CHOICES, cli_dtype



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="named config, tpinv checkpoint dir or HF model dir")
    p.add_argument("--input", required=True, help="prompts, one JSON object per line")
    p.add_argument("--output", required=True, help="results, one JSON object per line (written by rank 0)")
    p.add_argument("--tokenizer", help="tokenizer file or dir (default: the one in the model dir, if any)")
    p.add_argument("--dtype", choices=CLI_CHOICES, default="keep")
    p.add_argument("--init-seed", type=int, default=0, help="weights of a named config")
    p.add_argument("--max-batch", type=int, default=8, help="KV-cache slots (requests in flight)")
    p.add_argument("--max-context", type=int, help="positions per slot (default: the model's)")
    p.add_argument("--token-budget", type=int, help="tokens per step (decode tokens + admitted prompts)")
    p.add_argument("--eos-token-id", type=int, help="default: the tokenizer's")
    p.add_argument("--vanilla", action="store_true", help="the non-invariant control (BLAS, SDPA, all_reduce)")
    d = p.add_argument_group("request defaults")
    d.add_argument("--max-tokens", type=int, default=16)
    d.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    d.add_argument("--top-k", type=int, default=0)
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--top-logprobs", type=int, default=0)
    return p


def read_requests(path: str, defaults: dict):
    """``(requests, errors)``: errors maps a line index to the message of a line that is not a request."""
    from tpinv.engine.scheduler import request_from_json
    requests, errors = [], {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except UnicodeDecodeError as e:
        raise ValueError(f"--input {path} is not UTF-8 text (byte {e.start}: {e.reason}); expected one JSON "
                         f"object per line") from None
    for i, line in enumerate(lines):
        try:
            requests.append(request_from_json(json.loads(line), i, defaults))
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            requests.append(None)
            errors[i] = f"line {i}: {e}" if isinstance(e, json.JSONDecodeError) else str(e)
    return requests, errors


def check_paths(args) -> None:
    """Refuse a missing or unreadable --input and an unwritable --output before any model work."""
    if not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input}: " + ("is a directory" if os.path.isdir(args.input)
                                                     else "no such file"))
    if not os.access(args.input, os.R_OK):
        raise ValueError(f"--input {args.input}: not readable")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if os.path.isdir(args.output):
        raise ValueError(f"--output {args.output} is a directory; expected a file name")
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output {args.output}: the directory {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK) or (os.path.exists(args.output) and not os.access(args.output, os.W_OK)):
        raise ValueError(f"--output {args.output}: not writable")


def result_line(res, index: int, error_result) -> str:
    """One standard JSON line (never a bare NaN/Infinity); a non-finite value makes it an error result."""
    try:
        return json.dumps(res.to_json(), allow_nan=False)
    except ValueError:
        err = error_result(res.request_id, f"line {index}: the result holds a non-finite value (NaN or inf)")
        return json.dumps(err.to_json(), allow_nan=False)


def init_group():
    """``(tp_group, rank)``: the whole world is one TP group; none without torchrun."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return None, 0
    import torch.distributed as dist
    from tpinv.distributed.parallel import ParallelDims
    state = ParallelDims(int(os.environ["WORLD_SIZE"])).build()
    return state.tp_group, dist.get_rank()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_paths(args)
        return _run(args)
    except (ValueError, OSError) as e:
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        return 1
    finally:  # no rank exits with its process group up (gloo's threads abort at exit otherwise)
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _run(args) -> int:
    from tpinv.engine import Engine
    from tpinv.engine.scheduler import error_result
    from tpinv.io.tokenizer import load_tokenizer
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
                "top_p": args.top_p, "seed": args.seed, "top_logprobs": args.top_logprobs}
    requests, errors = read_requests(args.input, defaults)
    group, rank = init_group()
    engine = Engine.load(args.model, tp_group=group, dtype=cli_dtype(args.dtype), init_seed=args.init_seed,
                         tokenizer=load_tokenizer(args.tokenizer) if args.tokenizer else None,
                         max_batch=args.max_batch, max_context=args.max_context, token_budget=args.token_budget,
                         eos_token_id=args.eos_token_id, vanilla=args.vanilla)
    results = iter(engine.generate([r for r in requests if r is not None]))
    if rank == 0:
        with open(args.output, "w", encoding="utf-8") as f:
            for i, r in enumerate(requests):
                res = error_result(i, errors[i]) if r is None else next(results)
                f.write(result_line(res, i, error_result) + "\n")
        print(f"wrote {len(requests)} results to {args.output} ({len(errors)} unreadable lines)", file=sys.stderr)
    if group is not None:  # every rank waits for rank 0's results before the group is torn down
        import torch.distributed as dist
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
