"""Counters a kernel launch finds at zero and leaves at zero: no launch pays for a memset.

Invariant kept: a launch given :func:`counters` finds each of them at zero, provided every
launch that used them before left them at zero, and no launch that may run at the same time
holds the same ones.  Launches on one stream run one after another, so they share a set (a
host thread's on the CPU, where Triton's interpreter runs launches in turn); a launch captured
into a CUDA graph gets counters no other launch has (CUDA runs a graph's replays one after
another), from a store zeroed outside capture, or zeroes its own (a memset node in the graph)
once the store is spent or before any launch outside capture made it.

The split decode attention counts its chunks in and resets the count with its last one
(:mod:`tpinv.kernels.triton_attention_split`); the held softmax's cluster kernel counts each
program's arrival on its SM for its staggered start and takes it back as the program exits
(:mod:`tpinv.kernels.gluon_softmax_cluster`).
"""
from __future__ import annotations

import threading

import torch

from tpinv.core.capture import capturing

__all__ = ["counters", "CAPTURE_COUNTERS", "MIN_COUNTERS"]

#: Counters set aside for the launches captured into CUDA graphs, per device (1 MiB: a held
#: softmax launch takes 1024, a split attention launch one a (batch row, kv head) pair); past
#: them a captured launch zeroes counters of its own (a memset node: the same bits).
CAPTURE_COUNTERS = 1 << 18
#: The least a stream's set holds (a larger request replaces it with a larger one).
MIN_COUNTERS = 128


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=device)


_SERIAL: dict = {}     # (device, stream or thread) -> counters its launches share
_CAPTURED: dict = {}   # device -> [counters, next free]: handed out once, to captured launches


def counters(n: int, device: torch.device) -> torch.Tensor:
    """``n`` int32 counters at zero for one launch that leaves them at zero, never in use by a
    launch that may run at the same time (the module's rule)."""
    if device.type == "cuda" and capturing():
        store = _CAPTURED.get(device)
        if store is None or store[1] + n > store[0].numel():
            return _zeros(n, device)
        store[1] += n
        return store[0][store[1] - n:store[1]]
    who = (torch.cuda.current_stream(device).stream_id if device.type == "cuda"
           else threading.get_ident())
    mine = _SERIAL.get((device, who))
    if mine is None or mine.numel() < n:
        mine = _SERIAL[(device, who)] = _zeros(max(n, MIN_COUNTERS), device)
        if device.type == "cuda" and device not in _CAPTURED:
            _CAPTURED[device] = [_zeros(CAPTURE_COUNTERS, device), 0]
    return mine[:n]
