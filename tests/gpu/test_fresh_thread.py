"""Ops called first on a thread that has made no CUDA call yet (a new worker thread, the autograd
engine's device thread before its first kernel) run, and give the main thread's bits.

Encoding a host TMA descriptor needs a CUDA context current on the calling thread, which such a
thread lacks (:func:`tpinv.kernels.descriptors.on_cuda_context` gives it one).  The new thread's inputs
sit at new addresses, so its launches encode new descriptors; the test asserts the
thread really had no context when it started (through the driver API).  The products include the
backward's (transposed views), which the autograd engine's device thread runs first when a tpinv
product's gradient is the first node of a process's first backward.  Control: the matmul with
another leaf count differs.
"""
from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from tpinv import ops
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _context_current() -> bool:
    """Whether the calling thread has a CUDA context current (``cuCtxGetCurrent``)."""
    ctx = ctypes.c_void_p()
    assert ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value is not None


def _inputs():
    gen = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=gen).to("cuda", torch.bfloat16)  # noqa: E731
    q, k, v = r(1, 8, 333, 64), r(1, 4, 333, 64), r(1, 4, 333, 64)
    pos = torch.arange(333, device="cuda")[None]
    return dict(x=r(333, 1536), w=r(704, 1536), xs=r(24, 1536), dy=r(333, 704), q=q, k=k, v=v, pos=pos,
                nw=r(1536) + 1)


def _run(t, leaves):
    x, w, dy = t["x"], t["w"], t["dy"]
    return [ops.matmul(x, w, leaves, 1),                    # Gluon kernel: TMA loads and store
            ops.matmul(x.t().contiguous().t(), w, leaves, 1),  # x read as its transpose
            ops.matmul(t["xs"], w, leaves, 1),              # few rows: the Triton kernel
            ops.matmul(dy, w.t(), leaves, 1),               # the backward's dX and dW products
            ops.matmul(dy.t(), x.t(), 1, 1),
            ops.attention(t["q"], t["k"], t["v"], t["pos"]),
            ops.rms_norm(x, t["nw"], 1e-6)]


def _on_new_thread(fn):
    box = {}

    def body():
        box["had_context"] = _context_current()
        try:
            box["out"] = fn()
            torch.cuda.synchronize()
        except BaseException as err:    # reported on the main thread
            box["error"] = err

    th = threading.Thread(target=body)
    th.start()
    th.join()
    return box


def test_first_calls_on_a_new_thread_run_and_keep_bits():
    """The kernels are loaded and their launches bound on the main thread first (a kernel's first
    load would make a context current on its own); the new thread then gets copies of the inputs at
    new addresses, so its launches encode new descriptors before any other CUDA call of the thread."""
    t = _inputs()
    want = _run(t, 8)
    _run(t, 8)                                    # freed again: the allocator holds blocks for the thread
    fresh = {name: v.clone() for name, v in t.items()}
    torch.cuda.synchronize()
    box = _on_new_thread(lambda: _run(fresh, 8))
    assert box["had_context"] is False, "the thread had a CUDA context already: the case tests nothing"
    assert "error" not in box, f"first calls on a new thread failed: {box.get('error')!r}"
    for got, ref in zip(box["out"], want):
        assert_same_bits(got, ref)
    assert_bits_differ(_run(t, 4)[0], want[0])    # control: another leaf count differs
