"""Eager replay: a block's device work recorded once per call signature, then issued again with
only the tensors' addresses patched.

Invariant kept: a replay issues exactly the device work of the call it was recorded from, in
the same order -- the same aten ops with the same non-tensor arguments, the same compiled Triton
kernels with the same grids, integer arguments, constexprs and launch options -- on this call's
tensors, each at the place the recorded call's tensor had relative to the inputs, parameters and
new allocations it came from.  So a replay computes, for this call's inputs, the bits the
recorded code would compute: the kernels and their reduction orders are the recorded ones.

What a :class:`Recording` sees: every aten op below autograd (a ``TorchDispatchMode``; each
``tpinv::`` op is entered so that its kernel's own aten ops are seen, not the op as a whole) and
every Triton launch (:data:`tpinv.kernels.launch.RECORDER`).  It refuses
(:class:`ReplayRefused`) what a replay could not issue again: an op that reads device values on
the host (which could steer the host's code) or makes a shape from them, a launch not bound to the
compiled launcher's C entry, a pointer into memory the recording cannot name.  What could still
escape it -- device work issued some other way -- is what :mod:`tpinv.models.replayed_layer`'s
check of a program's first replay (on poisoned allocations, against the modular call) catches.

A :class:`Program` is a list of steps over a list of slots: the inputs first, then one slot per
tensor an op returned (or a view the recording had to name), then constants (tensors from outside
the block, e.g. a kernel's kept workspace, used as they are).  An aten step calls the op on its
slots; a launch step calls the kernel's C entry with each pointer argument ``slot address +
offset`` and each TMA descriptor rebuilt for its address (kept per address).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ALLOCATING", "Program", "Recording", "ReplayRefused", "poisoning", "pool_step", "same_bytes"]


class ReplayRefused(RuntimeError):
    """A block's device work cannot be replayed (the reason names what was seen)."""


#: Aten ops that allocate: a program's check fills their results with 0xFF bytes (NaN in every
#: float format) so that a replay reading memory the recorded code wrote some other way differs.
ALLOCATING = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
              "aten::new_empty_strided"}

#: Aten ops whose results depend on device values in a way a replay could not repeat: a value
#: read on the host (which may steer the host's code) or an output shape made from values.
_READS_DEVICE_VALUES = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero", "aten::allclose",
                        "aten::nonzero", "aten::nonzero_static", "aten::masked_select", "aten::unique",
                        "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
                        "aten::repeat_interleave", "aten::item", "aten::_assert_async", "aten::tolist"}

_POISON: list = [False]


class poisoning:
    """Within: every allocation a replay makes is filled with 0xFF bytes first."""

    def __enter__(self):
        _POISON[0] = True

    def __exit__(self, *exc):
        _POISON[0] = False


def _poison(t: torch.Tensor) -> None:
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    raw.set_(t.untyped_storage())
    raw.fill_(255)


def _launch():
    """:mod:`tpinv.kernels.launch`, imported on first use (a CPU-only process never imports Triton)."""
    from tpinv.kernels import launch
    _LAUNCH[:] = [launch]
    return launch


_LAUNCH: list = []   # [tpinv.kernels.launch] once imported here


class Program:
    """Steps over slots; :meth:`run` issues them on ``env`` (a list: the inputs, then room)."""

    def __init__(self, steps: list, size: int, constants: dict):
        self.steps, self.size, self.constants = steps, size, constants

    @property
    def launches(self) -> int:
        return sum(step.kind == "launch" for step in self.steps)

    @property
    def aten(self) -> int:
        return sum(step.kind == "aten" for step in self.steps)

    def env(self, inputs: list) -> list:
        env = inputs + [None] * (self.size - len(inputs))
        for slot, t in self.constants.items():
            env[slot] = t
        return env

    def run(self, env: list) -> list:
        # a program with launches was recorded over CUDA tensors, which imported the launch module
        stream = _LAUNCH[0]._current_stream(_LAUNCH[0]._current_device()) if _LAUNCH else None
        for step in self.steps:
            step(env, stream)
        return env


class Recording(TorchDispatchMode):
    """Records the device work issued within it over ``inputs`` (slots ``0..n-1``).

    Use as a context; :meth:`program` returns what was recorded.  Every tensor the recorded code
    touched is kept alive until the recording is dropped, so addresses name one tensor each."""

    def __init__(self, inputs: list):
        super().__init__()
        self.slots: list = []
        self.ranges: list = []       # per slot: (first byte, end) of its view, of its storage
        self.by_id: dict = {}
        self.constants: dict = {}
        self.steps: list = []
        self.refused: Optional[str] = None
        self._outer: list = []       # RECORDER before each (re-)entry
        self.cuda = any(t is not None and t.is_cuda for t in inputs)
        for t in inputs:
            self._new_slot(t)

    # -- slots -----------------------------------------------------------------------------------
    def _new_slot(self, t: Optional[torch.Tensor]) -> int:
        slot = len(self.slots)
        self.slots.append(t)
        if t is None:                          # an input left out (None): a slot that names nothing
            self.ranges.append((0, 0, 0, 0))
            return slot
        self.by_id[id(t)] = slot
        start = t.data_ptr()
        storage = t.untyped_storage()
        self.ranges.append((start, start + max(_extent(t), 1), storage.data_ptr(),
                            storage.data_ptr() + max(storage.nbytes(), 1)))
        return slot

    def _owner(self, ptr: int) -> Optional[tuple]:
        """``(slot, offset)`` of the first slot whose bytes hold address ``ptr``, else None."""
        for slot, (start, end, _, _) in enumerate(self.ranges):
            if start <= ptr < end:
                return slot, ptr - start
        for slot, (start, _, first, last) in enumerate(self.ranges):   # a storage's bytes outside any view
            if first <= ptr < last:
                return slot, ptr - start
        return None

    def slot_of(self, t: torch.Tensor) -> int:
        """The slot of tensor ``t``: its own, a view step on the slot holding its bytes, or a constant."""
        slot = self.by_id.get(id(t))
        if slot is not None:
            return slot
        owner = self._owner(t.data_ptr()) if t.numel() else None
        if owner is None:                      # from outside the block: used as it is
            slot = self._new_slot(t)
            self.constants[slot] = t
            return slot
        base, offset = owner
        base_t = self.slots[base]
        if base_t.dtype != t.dtype or offset % t.element_size():
            self.refuse(f"a {t.dtype} view at byte {offset} of a {base_t.dtype} tensor")
            return self._new_slot(t)
        slot = self._new_slot(t)
        self.steps.append(_view_step(base, slot, tuple(t.shape), t.stride(), offset // t.element_size()))
        return slot

    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason

    # -- aten ops ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("tpinv::"):
            kernel = _op_kernel(name, args)
            with self:                         # see the kernel's own aten ops and launches
                return kernel(*args, **kwargs)
        refs = [(i, self.slot_of(a)) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        lists = [(i, j, self.slot_of(b)) for i, a in enumerate(args) if isinstance(a, (list, tuple))
                 for j, b in enumerate(a) if isinstance(b, torch.Tensor)]
        named = [(k, self.slot_of(v)) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        if any(isinstance(v, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in v) for v in kwargs.values()):
            self.refuse(f"{name} takes a list of tensors by keyword")
        if name in _READS_DEVICE_VALUES:
            self.refuse(f"{name} reads device values on the host, or makes a shape from them")
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(o is None or isinstance(o, torch.Tensor) for o in outs):
            return out                         # a host value from shapes or dtypes (promote_types, ...)
        places = []
        for j, o in enumerate(outs):
            if o is None:
                continue
            known = self.by_id.get(id(o))
            places.append((j, known if known is not None else self._new_slot(o)))
        template = [None if isinstance(a, torch.Tensor) else       # no recorded tensor kept alive
                    ([None if isinstance(b, torch.Tensor) else b for b in a] if isinstance(a, (list, tuple))
                     else a) for a in args]
        poison = name in ALLOCATING
        self.steps.append(_aten_step(func, template, kwargs, refs, lists, named, places,
                                     isinstance(out, (tuple, list)), poison))
        return out

    # -- launches (tpinv.kernels.launch.RECORDER) --------------------------------------------------
    def launch(self, entry: tuple, grid: tuple, full: tuple) -> None:
        compiled, _tail, direct = entry[:3]
        if direct is None or not _launch().DIRECT[0]:
            self.refuse(f"a launch of {getattr(entry[3], '__name__', entry[3])} not through its C entry")
            return
        c_launch, cooperative, pdl, descriptors = direct
        template, pointers, descs = list(full), [], []
        for i, a in enumerate(full):
            if isinstance(a, torch.Tensor):
                owner = self._owner(a.data_ptr()) if a.numel() else None
                if owner is None:
                    owner = (self.slot_of(a), 0)
                pointers.append((i, *owner))
                template[i] = 0
            elif dataclasses.is_dataclass(a) and hasattr(a, "block_shape") and hasattr(a, "base"):
                owner = self._owner(a.base.data_ptr())
                if owner is None:
                    self.refuse("a TMA descriptor over memory outside the recorded block")
                    return
                descs.append((i, *owner, _descriptor_maker(a)))
                template[i] = None
        g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.steps.append(_launch_step(c_launch, g, compiled.function, cooperative, pdl,
                                       compiled.packed_metadata, template, pointers, descs, descriptors))

    def unbound(self, fn) -> None:
        self.refuse(f"a launch of {getattr(fn, '__name__', fn)} through Triton (not bound)")

    # -- context ---------------------------------------------------------------------------------
    def __enter__(self):
        recorder = _recorder(self.cuda)
        if recorder[0] is not None and recorder[0] is not self:
            raise RuntimeError("a recording is already running")
        self._outer.append(recorder[0])
        recorder[0] = self
        return super().__enter__()

    def __exit__(self, *exc):
        _recorder(self.cuda)[0] = self._outer.pop()
        return super().__exit__(*exc)

    def program(self) -> Program:
        """The recorded steps (raises :class:`ReplayRefused` with the first reason to refuse)."""
        if self.refused is not None:
            raise ReplayRefused(self.refused)
        return Program(list(self.steps), len(self.slots), dict(self.constants))


def _recorder(cuda: bool) -> list:
    """:data:`tpinv.kernels.launch.RECORDER` for a recording over CUDA tensors, or where the launch
    module is imported already; else a stand-in (a CPU-only recording imports no Triton)."""
    import sys
    module = _launch() if cuda else sys.modules.get("tpinv.kernels.launch")
    return module.RECORDER if module is not None else _NO_LAUNCHES


_NO_LAUNCHES: list = [None]


def same_bytes(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Same shape, strides, dtype and raw bytes (None only against None): a program's check."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype or a.device != b.device:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last."""
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
    return (last + 1) * t.element_size()


def _op_kernel(name: str, args: tuple) -> Callable:
    """The kernel a ``tpinv::`` op runs for ``args`` (its CUDA or CPU slot)."""
    from tpinv.ops.registry import OPS
    eager = OPS[name].op._tpinv_eager
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    return eager.cuda if cuda else eager.cpu


def _marked(step: Callable, kind: str, reads, writes, pure: bool = False, name: str = "") -> Callable:
    """``step`` with its kind, the slots it reads and makes, whether it only makes them (no device
    write to a slot it reads: a view, an allocation, an out-of-place op) and its op's name."""
    step.kind, step.reads, step.writes, step.pure, step.name = kind, frozenset(reads), frozenset(writes), pure, name
    return step


def _view_step(base: int, slot: int, shape: tuple, stride: tuple, offset: int) -> Callable:
    def step(env, stream):
        b = env[base]
        env[slot] = b.as_strided(shape, stride, b.storage_offset() + offset)
    return _marked(step, "view", (base,), (slot,), pure=True, name="as_strided")


def _aten_step(func, template: list, kwargs: dict, refs: list, lists: list, named: list, places: list,
               many: bool, poison: bool) -> Callable:
    kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}

    def step(env, stream):
        args = list(template)
        for i, s in refs:
            args[i] = env[s]
        for i, j, s in lists:
            if args[i] is template[i]:
                args[i] = list(template[i])
            args[i][j] = env[s]
        if named:
            out = func(*args, **kwargs, **{k: env[s] for k, s in named})
        else:
            out = func(*args, **kwargs)
        if many:
            for j, s in places:
                env[s] = out[j]
        elif places:
            env[places[0][1]] = out
        if poison and _POISON[0]:
            _poison(out)
    reads = {s for _, s in refs} | {s for _, _, s in lists} | {s for _, s in named}
    writes = {s for _, s in places}
    return _marked(step, "aten", reads, writes, pure=not func._schema.is_mutable and not (reads & writes),
                   name=func._schema.name)


def _descriptor_maker(desc) -> Callable:
    """``ptr -> descriptor``: ``desc`` rebuilt over address ``ptr`` (kept per address)."""
    from tpinv.kernels.descriptors import _Address
    kept: dict = {}
    dtype = desc.base.dtype
    desc = dataclasses.replace(desc, base=_Address(desc.base.data_ptr(), dtype))   # no recorded tensor kept

    def make(ptr: int):
        d = kept.get(ptr)
        if d is None:
            if len(kept) >= 64:
                kept.clear()
            d = kept[ptr] = dataclasses.replace(desc, base=_Address(ptr, dtype))
        return d
    return make


def _launch_step(c_launch, g: tuple, function, cooperative, pdl, packed, template: list, pointers: list,
                 descs: list, descriptors: tuple) -> Callable:
    from tpinv.kernels.descriptors import expand_descriptors
    g0, g1, g2 = g

    def step(env, stream):
        full = list(template)
        for i, s, d in pointers:
            full[i] = env[s].data_ptr() + d
        for i, s, d, make in descs:
            full[i] = make(env[s].data_ptr() + d)
        if descriptors:
            full = expand_descriptors(full, descriptors)
        c_launch(g0, g1, g2, stream, function, cooperative, pdl, None, None, packed, None, None, None, *full)
    step.pointers, step.descs = pointers, descs   # rewritten by tpinv.ops.replay_passes.pool_allocations
    return _marked(step, "launch", [s for _, s, _ in pointers] + [s for _, s, _, _ in descs], ())


def pool_step(slot: int, nbytes: int, device: torch.device) -> Callable:
    """A step making slot ``slot`` a buffer of ``nbytes`` bytes (filled with 0xFF while poisoning)."""

    def step(env, stream):
        env[slot] = t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if _POISON[0]:
            t.fill_(255)
    return _marked(step, "aten", (), (slot,), pure=True, name="pool")
