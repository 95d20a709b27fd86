"""``torchrun --nproc-per-node N launch/pretrain.py --tp T ...``: TP-invariant pretraining.

World = TP x DP from torchrun (DP = world / TP); gloo on CPU, NCCL when GPUs are present
(``--backend``).  The per-step losses (printed as decimal and hex float) and the final weights
(sha256 printed at the end) are the same bits at every ``--tp``; ``--vanilla`` runs the plain
torch/all_reduce control, whose curve changes with the TP size.  The loop lives in
:mod:`tpinv.training`; this file only parses flags and reports errors as ``error: ...``.
"""
from __future__ import annotations

import argparse
import sys

from tpinv.core.contract import DEFAULT_LEAVES


def parse_args(argv=None) -> argparse.Namespace:
    from tpinv.training import TrainConfig
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model and parallelism")
    m.add_argument("--model", default=d.model, help="named config (qwen3-tiny, llama-tiny, mistral-tiny, ...), "
                   "a HF model directory or a tpinv checkpoint")
    m.add_argument("--dtype", default=d.dtype, choices=("bf16", "fp32", "fp16"), help="model parameter dtype "
                   "(the master weights and gradients are always fp32)")
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel size (a power of two dividing --leaves)")
    m.add_argument("--dp", type=int, default=None, help="data-parallel size (default world / tp)")
    m.add_argument("--leaves", type=int, default=DEFAULT_LEAVES, help="leaf count of the contract (TP_MAX)")
    m.add_argument("--row-strategy", default=d.row_strategy, choices=("tree", "column_only"))
    m.add_argument("--sequence-parallel", action="store_true", help="Megatron's sequence parallelism: norms "
                   "and residuals on sequence chunks (the same bits as without it)")
    m.add_argument("--backend", default=None, choices=("gloo", "nccl"), help="default: nccl with GPUs, else gloo")
    m.add_argument("--dist-timeout", type=float, default=d.dist_timeout, help="seconds a rank waits for the "
                   "others before the run stops with an error naming the ranks that did not answer")
    m.add_argument("--vanilla", action="store_true", help="the control: plain torch/BLAS/all_reduce path")
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads per rank (results do not "
                   "depend on it; 1 is fastest for the tiny models on a small machine)")
    t = p.add_argument_group("optimization")
    t.add_argument("--steps", type=int, default=d.steps)
    t.add_argument("--global-batch", type=int, default=d.global_batch, help="sequences per step")
    t.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per forward/backward")
    t.add_argument("--seq-len", type=int, default=d.seq_len)
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--min-lr", type=float, default=None, help="end of the cosine decay (default lr / 10)")
    t.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    t.add_argument("--weight-decay", type=float, default=d.weight_decay)
    t.add_argument("--clip-grad", type=float, default=d.clip_grad, help="max global grad norm (0: off)")
    t.add_argument("--beta1", type=float, default=d.beta1)
    t.add_argument("--beta2", type=float, default=d.beta2)
    t.add_argument("--seed", type=int, default=d.seed)
    a = p.add_argument_group("data")
    a.add_argument("--data", default=d.data, help="'arithmetic' (built in) or a .txt / .jsonl file")
    a.add_argument("--tokenizer", default=None, help="tokenizer.json / tokenizer.model for --data files "
                   "(default: UTF-8 bytes)")
    a.add_argument("--digits", type=int, default=d.digits, help="arithmetic: digits per operand")
    a.add_argument("--heldout-size", type=int, default=d.heldout_size, help="arithmetic: held-out problems (default: a fifth, at most 256)")
    a.add_argument("--eval-every", type=int, default=d.eval_every, help="held-out accuracy every N steps (0: end)")
    c = p.add_argument_group("checkpoints and logs")
    c.add_argument("--save", default=None, help="checkpoint directory")
    c.add_argument("--save-every", type=int, default=0, help="save every K steps (and at the end)")
    c.add_argument("--overwrite", action="store_true", help="a fresh run may replace the checkpoints another run "
                   "left in --save (without it, and without --load, such a directory is refused)")
    c.add_argument("--load", default=None, help="resume from a checkpoint directory (its 'latest') or a step dir")
    c.add_argument("--stop-after", type=int, default=None, help="stop after this step (the schedule still "
                   "follows --steps); resume later with --load")
    c.add_argument("--log-dir", default=None, help="metrics.jsonl and loss_curve.png go here")
    c.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="tqdm progress bar (default: when stdout is a terminal)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace):
    from tpinv.training import TrainConfig
    return TrainConfig(model=args.model, dtype=args.dtype, steps=args.steps, global_batch=args.global_batch,
                       micro_batch=args.micro_batch, seq_len=args.seq_len, lr=args.lr, min_lr=args.min_lr,
                       warmup=args.warmup, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                       beta1=args.beta1, beta2=args.beta2, seed=args.seed, data=args.data, tokenizer=args.tokenizer,
                       digits=args.digits, heldout_size=args.heldout_size, eval_every=args.eval_every,
                       save=args.save, save_every=args.save_every, load=args.load, stop_after=args.stop_after,
                       vanilla=args.vanilla, leaves=args.leaves, row_strategy=args.row_strategy,
                       sequence_parallel=args.sequence_parallel,
                       log_dir=args.log_dir, progress=args.progress, overwrite=args.overwrite,
                       dist_timeout=args.dist_timeout)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    from tpinv.core import determinism
    from tpinv.distributed.parallel import ParallelDims
    from tpinv.training import train
    try:
        if args.threads is not None:
            import torch
            torch.set_num_threads(args.threads)
        determinism.enable(args.seed)
        config = config_from_args(args)
        config.check_numbers()  # before any process group or model is built
        if not args.dist_timeout > 0:
            raise ValueError(f"--dist-timeout {args.dist_timeout}: expected a number of seconds > 0")
        parallel = ParallelDims(tp=args.tp, dp=args.dp, leaves=args.leaves).build(backend=args.backend,
                                                                                 timeout=args.dist_timeout)
        train(config, parallel)
        return 0
    except (ValueError, TypeError, KeyError, OSError, RuntimeError, NotImplementedError, ArithmeticError) as e:
        message = " ".join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
