"""CUDA-graph capture: a step captured once and replayed, and the value reads that stand aside while capturing.

The invariant kept: a replay launches the eager step's kernels, in the eager step's order, on
the same buffers, so its logits are the eager step's logits bit for bit (and so the prefill's:
``tests/gpu/test_cuda_graph.py``).  Capture moves no arithmetic; it moves only the input
checks.  A check that reads tensor values on the host (token ids inside the vocabulary,
positions inside the cache, the reducer's cross-rank shape check) cannot run inside a capture,
so those checks read values through :func:`value_range`, which stands aside there, and
:class:`tpinv.engine.decode_graph.DecodeGraph` runs the
same value checks on its inputs before every replay.  Shape checks run at capture time,
on the shapes every replay reuses.

Under ``torch.compile`` no value can be read on the host either (a read would break the
graph): :func:`check_range` then puts the same range check into the graph as
``torch._assert_async``, which raises ``RuntimeError`` with a fixed message naming the range
at run time (eager raises the caller's error type naming the offending value).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["assert_range", "capture", "capturing", "check_range", "check_warmup", "compiling", "value_range"]


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def compiling() -> bool:
    """True while torch.compile (dynamo) traces the current code."""
    return torch.compiler.is_compiling()


def check_warmup(warmup: int) -> None:
    if warmup < 1:
        raise ValueError(f"warmup={warmup}: at least one eager run must precede the capture "
                         f"(Triton compiles its kernels there)")


def capture(run: Callable[[], object], *, warmup: int = 2,
            device: Optional[torch.device] = None) -> tuple[torch.cuda.CUDAGraph, object]:
    """``(graph, output)``: ``run()`` captured once after ``warmup`` eager runs on a side
    stream (Triton compiles there; the allocator settles).  ``graph.replay()`` reruns the
    captured kernels on the same buffers; ``output`` is what the captured call returned."""
    check_warmup(warmup)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = run()
    return graph, output


def value_range(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """``(min, max)`` of an integer tensor, read on the host in one transfer; None for an empty
    tensor, inside a CUDA-graph capture, where no value can be read (the captured step's
    runner checks its inputs before each replay), and for a fake tensor, which has no values
    (an op's input check runs in its fake and again, on the real values, at its kernel's entry).
    Every value check of a step goes through here, so none of them needs its own capture case."""
    if t.numel() == 0 or capturing() or is_fake(t):
        return None
    low, high = torch.aminmax(t)
    return tuple(torch.stack((low, high)).tolist())


def assert_range(t: torch.Tensor, low: int, end: int, what: str, where: str) -> None:
    """``low <= t < end`` asserted on ``t``'s device (``torch._assert_async``): no host read.  On
    CUDA a violation is a device-side assert at the next synchronisation; ``where`` ends the
    message (where the check ran)."""
    if t.numel():
        torch._assert_async(((t >= low) & (t < end)).all(), f"{what} outside [{low}, {end}) ({where})")


def check_range(t: torch.Tensor, end: int, error: Callable[[int, int], Exception], what: str) -> None:
    """Every value of the integer tensor ``t`` must lie in ``[0, end)``.

    Eager: the range is read on the host in one transfer and ``error(low, high)`` is raised.
    Inside a CUDA-graph capture: nothing (the captured step's runner checks before each replay).
    Under torch.compile: the check is a ``torch._assert_async`` node of the graph, run on every
    call; it raises ``RuntimeError`` with a fixed message naming ``what`` and the range."""
    if compiling():
        assert_range(t, 0, end, what, "checked inside the compiled graph")
        return
    bounds = value_range(t)
    if bounds is not None and (bounds[0] < 0 or bounds[1] >= end):
        raise error(*bounds)
