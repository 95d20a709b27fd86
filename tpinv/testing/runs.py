"""Comparing training runs: a run's per-step curve (loss and gradient-norm bits) and final weights.

:func:`run_summary` keeps what two runs must share to be "the same run, bit for bit" -- the hex of
every step's fp32 loss and gradient norm and the sha256 of the final weights and fp32 masters --
and :func:`assert_same_run` / :func:`assert_runs_differ` compare two summaries (the claim and
its negative control).
"""
from __future__ import annotations

__all__ = ["assert_runs_differ", "assert_same_run", "run_summary"]


def run_summary(result: dict, **extra) -> dict:
    """``{"curve", "sha", "master", **extra}`` of a :func:`tpinv.training.train` result."""
    return {"curve": [(r["step"], r["loss_hex"], r["grad_norm_hex"]) for r in result["history"]],
            "sha": result["weights_sha256"], "master": result["master_sha256"], **extra}


def assert_same_run(a: dict, b: dict, where: str) -> None:
    """The same per-step curve bits and the same final weights and masters."""
    assert a["curve"] == b["curve"], f"{where}: per-step curves differ:\n{a['curve']}\n{b['curve']}"
    assert a["sha"] == b["sha"] and a["master"] == b["master"], f"{where}: final weights differ"


def assert_runs_differ(a: dict, b: dict, where: str) -> None:
    """The negative control's assert: another curve and other final weights."""
    assert a["curve"] != b["curve"] and a["sha"] != b["sha"], f"{where}: the control did not differ"
