"""Metrics sinks beside ``metrics.jsonl``: TensorBoard event files and a Weights & Biases run.

The sinks carry the step records' numbers unchanged: each scalar of :data:`SCALAR_TAGS` is
written as the Python float of the record (TensorBoard as a double-precision tensor, W&B as
JSON), so what a dashboard shows is what ``metrics.jsonl`` and the step lines hold.  Only the
writer rank (global rank 0) opens a sink.  A sink that is asked for (its flag given) and
cannot be opened is an error on every rank, naming the pip extra that provides it; nothing
is skipped silently.

Flags (Megatron's names): ``--tensorboard-dir``; ``--wandb-project``, ``--wandb-exp-name``,
``--wandb-save-dir``.  W&B runs offline, with no network, under ``WANDB_MODE=offline``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from typing import Optional

import torch.distributed as dist

__all__ = ["EXTRA", "SCALAR_TAGS", "SinkError", "TensorBoardSink", "WandbSink", "check_sink_packages",
           "open_sinks", "require_package", "requested_sinks", "step_scalars", "wandb_save_dir"]

#: The setup.cfg extra that installs the sinks' packages.
EXTRA = "logging"

#: Step-record key -> the scalar's tag in TensorBoard and W&B.
SCALAR_TAGS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "clipped": "train/clipped",
    "loss_tokens": "train/loss_tokens",
    "consumed_samples": "train/consumed_samples",
    "tokens_per_s": "perf/tokens_per_s",
    "time_s": "perf/step_time_s",
    "heldout_exact": "heldout/exact_match",
    "heldout_token_acc": "heldout/token_accuracy",
}


class SinkError(RuntimeError):
    """A metrics sink that was asked for could not be opened or written."""


def step_scalars(rec: dict) -> dict[str, float]:
    """``{tag: value}`` of the step record's scalars (the ones it holds), as Python floats."""
    return {tag: float(rec[key]) for key, tag in SCALAR_TAGS.items() if key in rec}


def requested_sinks(cfg) -> list[tuple[str, str]]:
    """``(flag, import name)`` of each sink the settings ask for."""
    out = []
    if cfg.tensorboard_dir:
        out.append(("--tensorboard-dir", "tensorboard"))
    if cfg.wandb_project:
        out.append(("--wandb-project", "wandb"))
    elif cfg.wandb_exp_name or cfg.wandb_save_dir:
        raise ValueError("--wandb-exp-name / --wandb-save-dir need --wandb-project (the W&B project to log to)")
    return out


def require_package(flag: str, module: str) -> None:
    """ImportError naming ``flag`` and the pip extra when ``module`` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{flag} needs the {module!r} package, which is not installed: "
                          f"pip install 'tpinv[{EXTRA}]' (or pip install {module})")


def check_sink_packages(cfg) -> None:
    """Every requested sink's package is installed (checked on every rank, before any work)."""
    for flag, module in requested_sinks(cfg):
        require_package(flag, module)


class TensorBoardSink:
    """Scalars as TensorBoard event files in ``log_dir`` (one run directory)."""

    name = "tensorboard"

    def __init__(self, log_dir: str, *, config: Optional[dict] = None, start_step: int = 0):
        require_package("--tensorboard-dir", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter
        os.makedirs(log_dir, exist_ok=True)
        # every session starts with a restart marker at its first step: TensorBoard then hides the
        # events an earlier session wrote from that step on (after the checkpoint a run resumes from)
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=start_step + 1)
        self.where = log_dir
        if config is not None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, sort_keys=True) + "\n```", start_step)

    def log_step(self, rec: dict) -> None:
        for tag, value in step_scalars(rec).items():
            self.writer.add_scalar(tag, value, rec["step"], new_style=True, double_precision=True)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars as a W&B run (online, or offline under ``WANDB_MODE=offline``); the run id is tpinv's."""

    name = "wandb"

    def __init__(self, project: str, *, name: Optional[str], save_dir: Optional[str], run_id: str,
                 config: Optional[dict] = None, resume: bool = False):
        require_package("--wandb-project", "wandb")
        import wandb
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name or run_id, dir=save_dir, id=run_id, config=config,
                              resume="allow" if resume else None, reinit="create_new")
        self.where = self.run.dir

    def log_step(self, rec: dict) -> None:
        self.run.log(step_scalars(rec), step=rec["step"])

    def close(self) -> None:
        self.run.finish()


def wandb_save_dir(cfg) -> Optional[str]:
    """``--wandb-save-dir``, else ``<--save>/wandb`` (Megatron's choice), else ``<--log-dir>/wandb``."""
    if cfg.wandb_save_dir:
        return cfg.wandb_save_dir
    base = cfg.save or cfg.log_dir
    return os.path.join(base, "wandb") if base else None


def _check_log_dir(log_dir: str) -> None:
    """Create ``--log-dir`` and prove it writable (a probe file), or raise naming the flag."""
    try:
        os.makedirs(log_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=log_dir, prefix=".probe-"):
            pass
    except OSError as e:
        raise OSError(f"--log-dir {log_dir} is not writable ({e.strerror or e})") from None


def open_sinks(cfg, *, rank: int, distributed: bool, run_id: str, config: dict, start_step: int = 0) -> list:
    """The requested sinks, opened on global rank 0 (``[]`` elsewhere); collective when ``distributed``.

    Rank 0's verdict is broadcast, so a sink that fails to open stops every rank with the same error.
    """
    sinks, error = [], None
    if rank == 0:
        try:
            if cfg.log_dir:
                _check_log_dir(cfg.log_dir)
            if cfg.tensorboard_dir:
                sinks.append(TensorBoardSink(cfg.tensorboard_dir, config=config, start_step=start_step))
            if cfg.wandb_project:
                sinks.append(WandbSink(cfg.wandb_project, name=cfg.wandb_exp_name, save_dir=wandb_save_dir(cfg),
                                       run_id=run_id, config=config, resume=start_step > 0))
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"{type(e).__name__}: {e}"
            for s in sinks:
                s.close()
            sinks = []
    if distributed and dist.is_initialized() and dist.get_world_size() > 1 and (cfg.tensorboard_dir
                                                                                 or cfg.wandb_project
                                                                                 or cfg.log_dir):
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise SinkError(f"a metrics sink could not be opened on rank 0: {error}")
    return sinks
