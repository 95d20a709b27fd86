"""Eager training steps of a decoder layer replayed from a recorded program (one autograd node a layer).

Invariant kept: a replayed layer's output and every gradient have the bits of the layer's
modular code (its tpinv layers and ops, one autograd node each) for the same inputs: a replay
issues the recorded kernels and aten ops in the recorded order (:mod:`tpinv.ops.replay`), and a
program is used only after its first replay matched the modular code byte for byte, run on
allocations filled with 0xFF bytes, so that memory the recording did not see written shows.

Per call signature (shapes, strides, dtypes, 16-byte alignment of the inputs and parameters,
which need a gradient, the device) a layer goes through four calls:

0. **first sight**: the modular code runs (a signature that never comes again costs nothing);
1. **record**: the modular forward runs under a :class:`~tpinv.ops.replay.Recording`, and so
   does its backward (``torch.autograd.grad`` over the same graph, inside this layer's node);
2. **check**: the program replays on poisoned allocations, then the modular code runs; outputs
   and gradients are compared byte for byte.  The modular results are what the call returns;
   a mismatch turns replay off for the signature with a warning naming what differed;
3. **replay**: every later call runs the two programs: no module, op, plan or autograd node
   is entered, each kernel is launched through its C entry with its addresses patched.

Replay runs only where it is exact by construction and the host's time is the cost: a training
forward (grad enabled, the input needing a gradient) at TP=1, no cache, mask, packed positions,
dropout or recompute, not under ``torch.compile``, a dispatch or function mode, the profiler,
autocast, saved-tensor hooks (``torch.utils.checkpoint``) or a CUDA graph capture, plain tensors
(no subclass such as DTensor), on CUDA (on the CPU only when :data:`REPLAY_DEVICES` names it).  Anything
else runs the modular code.  :func:`replay_counts` says how many calls took each path.
"""
from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Callable, Optional

import torch
from torch.nn.modules import module as nn_module

from tpinv.core.autograd import PLAIN_TENSORS, observed
from tpinv.ops.replay import Program, Recording, ReplayRefused, poisoning, same_bytes
from tpinv.ops.replay_passes import pool_allocations, prune

__all__ = ["REPLAY", "REPLAY_DEVICES", "ReplayedLayer", "eligible", "replay_counts"]

#: ``[True]``: eligible calls replay (``TPINV_EAGER_REPLAY=0`` in the environment starts it off).
REPLAY = [os.environ.get("TPINV_EAGER_REPLAY", "1") != "0"]
#: Device types whose calls replay (tests add ``"cpu"`` to run the mechanism on the CPU kernels).
REPLAY_DEVICES = {"cuda"}

_COUNTS = {"record": 0, "check": 0, "replay": 0, "refused": 0}


def replay_counts() -> dict:
    """Calls so far by path: ``record``, ``check``, ``replay``, ``refused`` (a copy)."""
    return dict(_COUNTS)


class _Entry:
    """One call signature's state: ``record`` -> (``recording``) -> ``check`` -> ``ready`` | ``refused``."""

    def __init__(self):
        self.state, self.reason = "record", None
        self.forward = self.backward = None
        self.out_slot = self.grad_slot = None
        self.grad_slots: tuple = ()
        self.keep: tuple = ()              # forward slots the backward reads (saved for it)
        self.grad_layout: tuple = ()       # the recorded output gradient's strides
        self.recording = lambda: None      # while recording: a weak reference to the Recording


class ReplayedLayer:
    """Replay state of one module: :meth:`__call__` runs ``modular(x, *inputs)`` or its replay, with
    ``params`` (the module's parameters) as the program's inputs after ``x`` and ``inputs``.
    A copy (``copy.deepcopy`` or a pickle of the module) starts with no programs."""

    def __init__(self, name: str):
        self.name = name
        self.entries: dict = {}

    def __reduce__(self):                 # a copied or pickled module keeps no programs
        return ReplayedLayer, (self.name,)

    def __call__(self, modular: Callable, x: torch.Tensor, inputs: tuple, params: tuple) -> torch.Tensor:
        for t in (x, *inputs, *params):
            if t is not None and type(t) not in PLAIN_TENSORS:   # a tensor subclass (DTensor, ...):
                return modular(x, *inputs)                      # its addresses are not its data's
        key = _signature(x, inputs, params)
        entry = self.entries.get(key)
        if entry is None:                 # a signature seen once runs the modular code: one seen
            if len(self.entries) >= 64:   # again is recorded (a shape that never repeats costs nothing)
                self.entries.clear()
            self.entries[key] = _Entry()
            return modular(x, *inputs)
        if entry.state == "recording" and entry.recording() is None:
            entry.state = "record"        # the record call's graph was dropped before its backward
        if entry.state in ("recording", "refused"):
            return modular(x, *inputs)
        return _LayerNode.apply(self, entry, modular, len(inputs), x, *inputs, *params)


def eligible(x: torch.Tensor, module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` with input ``x`` may replay (see the module docstring): a
    training call on a replayed device (its CUDA device the current one), nothing watching or
    transforming it, no autocast (the recorded casts are the recording's), no saved-tensor hooks,
    no hook on any of ``module``'s submodules or on all modules (a replay enters no submodule, so
    their hooks would not run)."""
    if not (REPLAY[0] and x.requires_grad and x.device.type in REPLAY_DEVICES and torch.is_grad_enabled()):
        return False
    if observed() or _global_hooks() or _saved_tensor_hooks() or torch.is_autocast_enabled(x.device.type):
        return False
    if x.is_cuda and (x.device.index != torch.cuda.current_device() or torch.cuda.is_current_stream_capturing()):
        return False
    for sub in module.modules():
        if sub is not module and (sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks
                                  or sub._backward_pre_hooks):
            return False
    return True


def _saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are active (``torch.utils.checkpoint``, activation offloading):
    they act on what a node saves, which a replay saves differently from its record and check calls.
    torch before 2.8 cannot read the hook stack: there a call inside ``torch.utils.checkpoint``
    (its forward or its recomputation, both below a frame of that module) counts as hooked."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return _inside_checkpoint()
    try:
        return top(False) is not None
    except TypeError:                     # a signature without ignore_is_tracing
        return top() is not None


def _inside_checkpoint() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def _global_hooks() -> bool:
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)


def _signature(x, inputs, params) -> tuple:
    def sig(t):
        if not isinstance(t, torch.Tensor):
            return t
        return (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16, t.requires_grad)
    return (sig(x), tuple(sig(t) for t in inputs), tuple(sig(p) for p in params))


_HEAD = (None, None, None, None)   # no gradient for layer, entry, modular, the input count


class _LayerNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, entry, modular, n, x, *rest):
        inputs, params = rest[:n], rest[n:]
        ctx.layer, ctx.entry, ctx.n, ctx.params = layer, entry, n, params
        ctx.wants = tuple(p.requires_grad for p in params)
        ctx.env = ctx.inner = ctx.rec = None
        if entry.state == "ready":
            _COUNTS["replay"] += 1
            ctx.mode = "replay"
            env = entry.forward.env([x, *inputs, *params])
            entry.forward.run(env)
            ctx.save_for_backward(*[env[s] for s in entry.keep])   # freed by autograd as any saved tensor
            return env[entry.out_slot]
        x_in = x.detach().requires_grad_(True)
        if entry.state == "record":
            _COUNTS["record"] += 1
            ctx.mode, entry.state = "record", "recording"
            rec = Recording([x_in, *inputs, *params])
            try:
                with torch.enable_grad(), rec:
                    y = modular(x_in, *inputs)
            except BaseException:
                entry.state = "record"
                raise
            ctx.rec, ctx.split, ctx.out_slot = rec, len(rec.steps), rec.by_id.get(id(y))
            entry.recording = weakref.ref(rec)
            ctx.inner = (x_in, y)
            return y.detach()
        # check: the program on poisoned allocations first, then the modular code
        _COUNTS["check"] += 1
        ctx.mode = "check"
        with poisoning():
            env = entry.forward.env([x, *inputs, *params])
            entry.forward.run(env)
        with torch.enable_grad():
            y = modular(x_in, *inputs)
        ctx.inner, ctx.env = (x_in, y), env
        if not same_bytes(env[entry.out_slot], y):
            _refuse(layer, entry, "the forward output")
        return y.detach()

    @staticmethod
    def backward(ctx, g):
        layer, entry, mode = ctx.layer, ctx.entry, ctx.mode
        if torch.is_grad_enabled():
            raise RuntimeError(f"{layer.name}: a replayed layer has no double backward (create_graph=True); "
                               f"set tpinv.models.replayed_layer.REPLAY[0] = False for this run")
        wanted = [p for p, w in zip(ctx.params, ctx.wants) if w]
        if mode == "replay":
            env = entry.backward.env([])
            for s, t in zip(entry.keep, ctx.saved_tensors):
                env[s] = t
            env[entry.grad_slot] = _in_layout(g, entry.grad_layout)
            entry.backward.run(env)
            grads = [None if s is None else env[s] for s in entry.grad_slots]
            return (*_HEAD, grads[0], *([None] * ctx.n), *_spread(grads[1:], ctx.wants))
        # record and check: the inner (modular) graph is kept for a second backward (retain_graph)
        x_in, y = ctx.inner
        rec, ctx.rec = ctx.rec, None
        if rec is not None:                          # the record call's first backward
            g_slot = rec._new_slot(g)
            try:
                with rec:
                    grads = torch.autograd.grad(y, [x_in, *wanted], g, allow_unused=True, retain_graph=True)
            except BaseException:
                entry.state = "record"
                raise
            try:
                _finish(entry, rec, ctx.split, ctx.out_slot, g, g_slot, grads)
            except ReplayRefused as exc:
                entry.state, entry.reason = "refused", str(exc)
                _COUNTS["refused"] += 1
                warnings.warn(f"{layer.name}: eager replay is off for this call signature: {exc}",
                              RuntimeWarning, stacklevel=2)
            return (*_HEAD, grads[0], *([None] * ctx.n), *_spread(grads[1:], ctx.wants))
        env, ctx.env = ctx.env, None
        # the check call's first backward (a mismatch in the forward refused the signature already)
        checking = mode == "check" and env is not None and entry.state == "check"
        if checking:
            with poisoning():
                env[entry.grad_slot] = _in_layout(g, entry.grad_layout)
                entry.backward.run(env)
        grads = torch.autograd.grad(y, [x_in, *wanted], g, allow_unused=True, retain_graph=True)
        if checking:
            for i, (s, mine) in enumerate(zip(entry.grad_slots, grads)):
                if not same_bytes(None if s is None else env[s], mine):
                    _refuse(layer, entry, "the input's gradient" if i == 0 else f"parameter gradient {i - 1}")
                    break
            else:
                entry.state = "ready"
        return (*_HEAD, grads[0], *([None] * ctx.n), *_spread(grads[1:], ctx.wants))


def _spread(grads, wants) -> list:
    """Gradients of the wanted parameters placed at every parameter's position (None elsewhere)."""
    it = iter(grads)
    return [next(it) if w else None for w in wants]


def _in_layout(g: torch.Tensor, layout: tuple) -> torch.Tensor:
    """``g`` in the recorded gradient's strides (an exact copy where they differ)."""
    if g.stride() == layout:
        return g
    out = torch.empty_strided(g.shape, layout, dtype=g.dtype, device=g.device)
    out.copy_(g)
    return out


def _finish(entry: _Entry, rec: Recording, split: int, out_slot: Optional[int], g: torch.Tensor, g_slot: int,
            grads: tuple) -> None:
    """Split the recording into the forward and backward programs; the entry moves to ``check``."""
    if out_slot is None:
        raise ReplayRefused("the layer's output is not a tensor an op returned")
    program = rec.program()
    slots = [None if t is None else rec.by_id.get(id(t)) for t in grads]
    if any(t is not None and s is None for t, s in zip(grads, slots)):
        raise ReplayRefused("a gradient is not a tensor an op returned")
    forward_steps, backward_steps = program.steps[:split], program.steps[split:]
    outputs = {s for s in slots if s is not None}
    backward_steps = prune(backward_steps, outputs)
    forward_steps = prune(forward_steps, {out_slot}.union(*(s.reads for s in backward_steps)))
    forward_steps, backward_steps, size = pool_allocations(rec, forward_steps, backward_steps, outputs | {out_slot})
    reads, made = set(), set()          # slots the backward reads before it makes them: the forward's
    for step in backward_steps:
        reads |= step.reads - made
        made |= step.writes
    entry.forward = Program(forward_steps, size, program.constants)
    entry.backward = Program(backward_steps, size, program.constants)
    entry.keep = tuple(sorted(reads - set(program.constants) - {g_slot}))
    entry.out_slot, entry.grad_slot, entry.grad_slots = out_slot, g_slot, tuple(slots)
    entry.grad_layout = g.stride()
    entry.state = "check"


def _refuse(layer: ReplayedLayer, entry: _Entry, what: str) -> None:
    entry.state, entry.reason = "refused", f"{what} differed from the modular code's"
    _COUNTS["refused"] += 1
    warnings.warn(f"{layer.name}: eager replay turned off for this call signature: {entry.reason} on the "
                  f"check call (the modular code's results are used)", RuntimeWarning, stacklevel=3)
