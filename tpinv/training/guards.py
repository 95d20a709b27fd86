"""Guards of a training run: nothing out of range starts, nothing non-finite is applied or saved,
no run writes into another run's directory, and a rank that stops answering is named.

* :func:`check_optimizer_numbers` refuses optimizer settings that are not finite or out of
  range, listing every bad one, before any process group or model exists;
* :func:`check_finite` stops a step whose loss or gradient norm is NaN/inf *before* the
  optimizer update (both values are reduced over the whole group, so every rank stops alike);
* :func:`claim_save_dir` runs :func:`tpinv.io.run_dir.claim_run_dir` on global rank 0 and
  broadcasts its verdict, so every rank raises the same error;
* :func:`watchdog` is a gloo monitored barrier naming the ranks that did not arrive in time;
* :func:`changed_on_resume` lists the settings a resumed run changed; :func:`config_sha256`
  fingerprints the settings that define a run (saved with every checkpoint).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
from typing import Optional

import torch
import torch.distributed as dist

from tpinv.io.run_dir import RunDirError, RunLock, claim_run_dir

__all__ = ["NonFiniteError", "RESUME_KEYS", "changed_on_resume", "check_finite", "check_optimizer_numbers",
           "claim_save_dir", "config_sha256", "watchdog"]

#: Settings whose change at resume makes the rest of the run differ from the uninterrupted one.
RESUME_KEYS = ("data", "tokenizer", "digits", "seed", "global_batch", "seq_len", "steps", "lr", "min_lr", "warmup",
               "weight_decay", "clip_grad", "beta1", "beta2", "eps", "heldout_size", "hidden_dropout",
               "attention_dropout", "data_path", "vanilla")
#: Settings that say where a run saves, loads, logs or stops, or how much memory it takes, not what it computes.
_PLACE_KEYS = ("save", "load", "stop_after", "log_dir", "progress", "overwrite", "dist_timeout", "tensorboard_dir",
               "wandb_project", "wandb_exp_name", "wandb_save_dir", "log_level", "async_save", "keep_last",
               "exit_signal_handler", "cross_entropy_chunk_tokens", "recompute_granularity", "recompute_method",
               "recompute_num_layers")


class NonFiniteError(FloatingPointError):
    """A step produced a NaN or infinite loss or gradient norm; the step was not applied."""


def check_optimizer_numbers(cfg) -> None:
    """ValueError listing every optimizer setting of ``cfg`` that is not finite or out of range."""
    bad = []

    def need(name: str, ok, what: str) -> None:
        v = getattr(cfg, name)
        if not math.isfinite(v) or not ok(v):
            bad.append(f"{name}={v} ({what})")
    need("lr", lambda v: v > 0, "must be finite and > 0")
    if cfg.min_lr is not None:
        need("min_lr", lambda v: 0 <= v <= cfg.lr, f"must be finite, >= 0 and <= lr={cfg.lr}")
    need("weight_decay", lambda v: v >= 0, "must be finite and >= 0")
    need("clip_grad", lambda v: v >= 0, "must be finite and > 0, or 0 for no clipping")
    need("beta1", lambda v: 0 <= v < 1, "must be in [0, 1)")
    need("beta2", lambda v: 0 <= v < 1, "must be in [0, 1)")
    need("eps", lambda v: v > 0, "must be finite and > 0")
    if bad:
        raise ValueError("bad optimizer setting: " + "; ".join(bad))


def check_finite(step: int, loss: torch.Tensor, norm: torch.Tensor, save: Optional[str]) -> None:
    """Raise :class:`NonFiniteError` naming ``step`` if the loss or the gradient norm is not finite."""
    loss_f, norm_f = float(loss), float(norm)
    if math.isfinite(loss_f) and math.isfinite(norm_f):
        return
    kept = f"; the last checkpoint in {save} is untouched" if save else ""
    raise NonFiniteError(f"step {step}: the loss is {loss_f} and the gradient norm {norm_f}; the step was not "
                         f"applied and nothing was saved{kept} (lower --lr or check the data)")


def claim_save_dir(save: str, *, rank: int, distributed: bool, run_id: str, resume: bool,
                   overwrite: bool) -> Optional[RunLock]:
    """Check and lock ``save`` on rank 0 (collective when ``distributed``); the lock on rank 0, else None."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = claim_run_dir(save, run_id=run_id, resume=resume, overwrite=overwrite)
        except (RunDirError, OSError) as e:
            error = str(e)
    if distributed and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise RunDirError(error)
    return lock


def watchdog(step: int, timeout_s: float) -> None:
    """A monitored barrier (gloo only; a no-op otherwise) that names the ranks missing after ``timeout_s``."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() != "gloo":
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        raise RuntimeError(f"step {step}: a rank stopped answering within --dist-timeout {timeout_s:g} s: "
                           f"{' '.join(str(e).split())[:400]}") from None


def changed_on_resume(saved: dict, now: dict) -> list[str]:
    """``"key (checkpoint X, this run Y)"`` for each of :data:`RESUME_KEYS` that differs."""
    return [f"{k} (checkpoint {saved[k]!r}, this run {now[k]!r})" for k in RESUME_KEYS
            if k in saved and k in now and saved[k] != now[k]]


def config_sha256(config: dict) -> str:
    """sha256 of the settings that define a run (not where it saves, loads, logs or stops)."""
    d = {k: v for k, v in config.items() if k not in _PLACE_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
