"""``torchrun --nproc-per-node N launch/pretrain.py --tp T ...``: TP-invariant pretraining.

World = TP x DP from torchrun (DP = world / TP); gloo on CPU, NCCL when GPUs are present
(``--backend``); ``python launch/pretrain.py`` without torchrun runs one rank (TP=1, DP=1) as
``torchrun --nproc-per-node 1`` would.  The per-step losses (printed as decimal and hex float) and the final weights
(sha256 printed at the end) are the same bits at every ``--tp``; ``--vanilla`` runs the plain
torch/all_reduce control, whose curve changes with the TP size.  Settings come from flags, over
a ``--config run.yaml`` file, over the defaults (:mod:`tpinv.training.config`).  The loop lives
in :mod:`tpinv.training`; this file only parses flags and reports errors as ``error: ...``.
"""
from __future__ import annotations

import os
import sys


def parse_args(argv=None):
    """``(TrainConfig, LaunchConfig)`` from the flags, over the ``--config`` YAML file, over the defaults."""
    from tpinv.training.config import parse_configs
    return parse_configs(argv, description=__doc__.split("\n\n")[0])


def _one_rank_without_torchrun(launch) -> None:
    """Started without torchrun: a world of this one process (as ``torchrun --nproc-per-node 1``),
    or an error naming the command where the flags ask for more ranks."""
    ranks = launch.tp * (launch.dp or 1)
    if ranks > 1:
        raise ValueError(f"--tp {launch.tp}" + (f" --dp {launch.dp}" if launch.dp else "") + f" needs {ranks} "
                         f"ranks: start it with torchrun --nproc-per-node {ranks} launch/pretrain.py ...")
    import socket
    with socket.socket() as sock:   # a free port for the one-rank group's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main(argv=None) -> int:
    import torch.distributed as dist

    from tpinv.core import determinism
    from tpinv.distributed.parallel import ParallelDims
    from tpinv.training import train
    from tpinv.training.sinks import check_sink_packages
    try:
        config, launch = parse_args(argv)
        if launch.threads is not None:
            import torch
            torch.set_num_threads(launch.threads)
        determinism.enable(config.seed)
        config.check_numbers()  # before any process group or model is built
        check_sink_packages(config)
        if not config.dist_timeout > 0:
            raise ValueError(f"--dist-timeout {config.dist_timeout}: expected a number of seconds > 0")
        if "RANK" not in os.environ:
            _one_rank_without_torchrun(launch)
        parallel = ParallelDims(tp=launch.tp, dp=launch.dp, leaves=config.leaves).build(backend=launch.backend,
                                                                                       timeout=config.dist_timeout)
        train(config, parallel)
        return 0
    except (ValueError, TypeError, KeyError, OSError, RuntimeError, NotImplementedError, ArithmeticError,
            ImportError) as e:
        message = " ".join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
