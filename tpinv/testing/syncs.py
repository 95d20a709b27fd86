"""Host synchronizations counted: where a CUDA call makes the host wait for the device.

:func:`host_syncs` runs a function under ``torch.cuda.set_sync_debug_mode("warn")`` and returns
the source line of each synchronizing call it made, so a test (or ``tools/gpu_sync_count.py``)
can say how many a step makes and where; :func:`training_step_syncs` counts one eager training step
of a model with the control beside it.  The mode sees the calls torch marks as synchronizing
(host reads of device values, ``.item()``, ``.tolist()``, ...): a count is a lower bound.
"""
from __future__ import annotations

import os
import warnings
from typing import Callable

import torch

__all__ = ["host_syncs", "training_step_syncs"]


def host_syncs(fn: Callable[[], object]) -> list[str]:
    """``file:line`` (relative to the working directory) of each synchronizing call ``fn()``
    makes on the current CUDA device; the device is idle before and after."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return [f"{os.path.relpath(w.filename)}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)]


def training_step_syncs(model, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[list[str], list[str]]:
    """``(step, control)``: :func:`host_syncs` of one eager training step of ``model`` (zero the
    gradients, ``model.loss(tokens, targets).sum()``, backward), run three times before to warm
    every cache -- on CUDA a decoder layer's eager replay records on its second call and checks on
    its third, comparing on the host (:mod:`tpinv.models.replayed_layer`), so the step counted is
    the replayed one every later step is -- and of the same step plus one ``loss.item()`` (the
    control: one more)."""
    def step():
        model.zero_grad(set_to_none=True)
        loss = model.loss(tokens, targets).sum()
        loss.backward()
        return loss

    for _ in range(3):
        step()
    return host_syncs(step), host_syncs(lambda: step().item())
