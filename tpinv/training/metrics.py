"""Training logs: one line per step, a JSONL metrics file, a progress bar, a loss-curve PNG, and
the metrics sinks (TensorBoard, W&B: :mod:`tpinv.training.sinks`) fed the same step records.

Only the writer rank (global rank 0) logs.  Each step line shows the loss both as a decimal and
as ``float.hex()`` -- the exact bits of the fp32 value -- so two runs can be compared by eye or
by ``diff``; the JSONL file holds the same records for programs.
"""
from __future__ import annotations

import json
import os
import sys
from typing import IO, Optional, Sequence

__all__ = ["MetricsLogger", "format_step", "plot_loss_curve", "read_metrics", "METRICS_FILE", "PLOT_FILE"]

METRICS_FILE, PLOT_FILE = "metrics.jsonl", "loss_curve.png"


def format_step(rec: dict, total: int) -> str:
    """``step   5/100 | loss 2.718282 (0x1.5bf0a8p+1) | grad_norm ... | lr ... | tok/s ...``."""
    width = len(str(total))
    line = (f"step {rec['step']:>{width}}/{total} | loss {rec['loss']:.6f} ({rec['loss_hex']}) | "
            f"grad_norm {rec['grad_norm']:.4f} ({rec['grad_norm_hex']}) | lr {rec['lr']:.3e} | "
            f"{rec['tokens_per_s']:.0f} tok/s")
    if "heldout_exact" in rec:
        line += f" | heldout exact {100 * rec['heldout_exact']:.1f}% token {100 * rec['heldout_token_acc']:.1f}%"
    return line


class MetricsLogger:
    """Writes step lines to ``stream``, records to ``LOG_DIR/metrics.jsonl``, a tqdm bar on a terminal,
    and each step record to every sink of ``sinks`` (objects with ``log_step(rec)`` and ``close()``)."""

    def __init__(self, total_steps: int, *, log_dir: Optional[str] = None, enabled: bool = True,
                 progress: Optional[bool] = None, stream: Optional[IO[str]] = None, start_step: int = 0,
                 sinks: Sequence = ()):
        self.total, self.enabled, self.log_dir = total_steps, enabled, log_dir
        self.sinks = list(sinks) if enabled else []
        self.stream = stream if stream is not None else sys.stdout
        self.records: list[dict] = []
        self._file = self._bar = None
        if not enabled:
            return
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, METRICS_FILE)
            if start_step:
                drop_records_after(path, start_step)
            self._file = open(path, "a" if start_step else "w", encoding="utf-8")
        if progress is None:
            progress = hasattr(self.stream, "isatty") and self.stream.isatty()
        if progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", file=self.stream,
                             dynamic_ncols=True, leave=False)

    def _write_line(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def _record(self, rec: dict) -> None:
        self.records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def step(self, rec: dict) -> None:
        if not self.enabled:
            return
        self._record(dict(rec, event="step"))
        self._write_line(format_step(rec, self.total))
        for sink in self.sinks:
            sink.log_step(rec)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{rec['loss']:.4f}")

    def event(self, kind: str, rec: dict, line: Optional[str] = None) -> None:
        """A non-step record (``"start"``, ``"checkpoint"``, ``"final"``), with an optional line."""
        if not self.enabled:
            return
        self._record(dict(rec, event=kind))
        if line:
            self._write_line(line)

    def close(self) -> None:
        while self.sinks:
            self.sinks.pop().close()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


def drop_records_after(path: str, step: int) -> None:
    """Keep the records of ``path`` (a ``metrics.jsonl``) before its first step record past
    ``step``: a run resumed from the checkpoint of ``step`` writes the later steps again, so each
    step has one record (the earlier session's tail after that step is dropped, as TensorBoard
    drops it).  Rewritten in one rename; a missing file is left missing."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    keep = len(lines)   # the index of the first line dropped (none: all kept)
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:   # a torn last line of a killed run
            keep = i
            break
        if rec.get("event", "step") == "step" and rec.get("step", 0) > step:
            keep = i
            break
    if keep == len(lines):
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines[:keep])
    os.replace(tmp, path)


def read_metrics(path: str) -> list[dict]:
    """The records of a ``metrics.jsonl`` file (or the directory holding it)."""
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss_curve(records: list[dict], path: str, title: str = "training loss") -> str:
    """Loss per step (and held-out exact-match accuracy, when measured) as a PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    steps = [r for r in records if r.get("event", "step") == "step"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], color="tab:blue", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax.set_title(title)
    evals = [r for r in steps if "heldout_exact" in r]
    if evals:
        acc = ax.twinx()
        acc.plot([r["step"] for r in evals], [100 * r["heldout_exact"] for r in evals], "o-", color="tab:green",
                 label="held-out exact match %")
        acc.set_ylabel("held-out exact match (%)", color="tab:green")
        acc.set_ylim(0, 100)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
