"""Generate from a jsonl file of prompts with the tpinv engine (a thin torchrun CLI).

    torchrun --nproc-per-node C launch/generate.py --model MODEL --input prompts.jsonl --output results.jsonl
    python launch/generate.py --model qwen3-tiny --input prompts.jsonl --output results.jsonl   # TP=1

MODEL is a named config (random weights from --init-seed, no tokenizer), a tpinv checkpoint
directory or a HF model directory (with the tokenizer found in it); the TP size is the number of
ranks.  Each input line is a JSON object: ``{"id": ..., "prompt_ids": [ids]}`` or, with a
tokenizer, ``{"id": ..., "prompt": "text"}``, optionally ``max_tokens``, ``temperature``,
``top_k``, ``top_p``, ``seed``, ``top_logprobs`` (their defaults are the flags of the same
names), ``stop`` (strings; needs a tokenizer), ``stop_token_ids`` and ``ignore_eos``.  A line
without an ``id`` takes its index among the non-blank lines, from 0.  Each output line holds
the request's ``id``, ``prompt_ids``, ``token_ids``, ``text``, ``logprobs`` (raw model
log-probs, the training forward's bits), ``sampled_logprobs`` (under the distribution sampled
from, after temperature/top-k/top-p), ``finish_reason`` and ``error``, in input order.  A bad
line gets an error result naming its line of the file and keeps its place: every other line is
generated exactly as it would be were that line a good request.  Bad flag values are refused
before the model is built.  Exit status 0 when at least one request was generated (or the file
has none), 1 when none could be (every line an error) or on any error before generation.
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
    p.add_argument("--eos-token-id", type=int, help="default: the tokenizer's; a negative id: no EOS")
    p.add_argument("--vanilla", action="store_true", help="the non-invariant control (BLAS, SDPA, all_reduce)")
    d = p.add_argument_group("request defaults")
    d.add_argument("--max-tokens", type=int, default=16)
    d.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    d.add_argument("--top-k", type=int, default=0)
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--top-logprobs", type=int, default=0)
    return p


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


def result_line(res, number: int, error_result) -> tuple[str, Optional[str]]:
    """``(line, error)``: one standard JSON line (never a bare NaN/Infinity) and the result's
    error (None if it has none); a non-finite value makes it an error result naming the
    request's line of the file, ``number``."""
    record = res.to_json()
    try:
        return json.dumps(record, allow_nan=False), record.get("error")
    except ValueError:
        message = f"line {number}: the result holds a non-finite value (NaN or inf)"
        record = error_result(res.request_id, message).to_json()
        return json.dumps(record, allow_nan=False), record["error"]


def check_request_defaults(args) -> None:
    """Refuse a bad request-default flag (``--top-k -1``, ``--max-tokens 0``, ...) before any
    model work, as each request would be refused with it, and ``--eos-token-id`` outside the
    vocabulary: the model's sizes come from its config alone."""
    from tpinv.engine.sampling import SamplingParams
    from tpinv.engine.scheduler import Request, validate_request
    from tpinv.io.loading import source_model_args
    model_args, _ = source_model_args(args.model)
    probe = Request(0, [0], max_tokens=args.max_tokens, top_logprobs=args.top_logprobs,
                    sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed))
    try:
        validate_request(probe, vocab_size=model_args.vocab_size, max_context=2)
    except (ValueError, TypeError) as e:
        raise ValueError(f"a request-default flag (--max-tokens, --temperature, --top-k, --top-p, --seed, "
                         f"--top-logprobs) is out of range: {e}") from None
    eos = args.eos_token_id
    if eos is not None and eos >= model_args.vocab_size:
        raise ValueError(f"--eos-token-id {eos}: expected a token id below vocab_size={model_args.vocab_size} "
                         f"(or a negative one: no EOS)")


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
        check_request_defaults(args)
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
    from tpinv.engine.scheduler import error_result, read_requests_jsonl
    from tpinv.io.tokenizer import load_tokenizer
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
                "top_p": args.top_p, "seed": args.seed, "top_logprobs": args.top_logprobs}
    try:
        lines = read_requests_jsonl(args.input, defaults)
    except ValueError as e:
        raise ValueError(f"--input {e}") from None
    group, rank = init_group()
    engine = Engine.load(args.model, tp_group=group, dtype=cli_dtype(args.dtype), init_seed=args.init_seed,
                         tokenizer=load_tokenizer(args.tokenizer) if args.tokenizer else None,
                         max_batch=args.max_batch, max_context=args.max_context, token_budget=args.token_budget,
                         eos_token_id=args.eos_token_id, vanilla=args.vanilla)
    results = iter(engine.generate([line.request for line in lines if line.request is not None]))
    texts, failed = [], []   # failed: (line number, message) of each error result
    for i, line in enumerate(lines):
        res = error_result(i, line.error) if line.request is None else next(results)
        text, error = result_line(res, line.number, error_result)
        texts.append(text)
        if error is not None:
            failed.append((line.number, error.removeprefix(f"line {line.number}: ")))
    if rank == 0:
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(text + "\n" for text in texts)
        first = f" (the first, line {failed[0][0]}: {failed[0][1]})" if failed else ""
        print(f"wrote {len(lines)} results to {args.output}: {len(lines) - len(failed)} generated, "
              f"{len(failed)} errors{first}", file=sys.stderr)
    if group is not None:  # every rank waits for rank 0's results before the group is torn down
        import torch.distributed as dist
        dist.barrier()
    if lines and len(failed) == len(lines):
        if rank == 0:
            sys.stderr.write(f"error: no request of {args.input} could be generated (every line is an error "
                             f"result)\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
