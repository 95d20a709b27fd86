"""Launching Triton kernels with less host work: each specialization bound once.

Invariant kept: a launch runs exactly the compiled kernel Triton's own ``kernel[grid](...)``
would run for the same arguments -- the first launch of a specialization goes through Triton
(which compiles or finds the kernel), later launches of it call that compiled kernel's launcher
directly.  A specialization is named by a key that holds every integer argument's value, every
tensor's dtype and 16-byte alignment, and every constexpr and launch option -- a superset of
what Triton specializes on -- so a bound kernel is never launched with arguments Triton would
have compiled differently.  Only the launch path changes (host time), never the arithmetic.

:func:`launch` is the call sites' ``kernel[grid](*args, **kwargs)``; a call site that plans its
launches per shape (:func:`operands_key`, :func:`remember`) keeps the bound launcher with its plan
(``bound=``) and skips building and looking up a key per call; once that launch is bound
(:func:`is_bound`), its TMA descriptors are built once per address
(:func:`tpinv.kernels.descriptors.reused_descriptor`).
Where Triton's CUDA launcher has the form of Triton 3.6's, a bound launch calls the compiled launcher's C entry itself
(:data:`DIRECT`): the arguments Triton's Python wrapper would pass, each host TMA descriptor
expanded by Triton's own ``make_tensordesc_arg`` once per kernel parameter and kept with the
descriptor (:func:`tpinv.kernels.descriptors.expand_descriptors`).
Triton versions without the launcher API used here (and Triton's interpreter) launch through
Triton every time: same kernel, more host time.  A bound launch passes Triton's launch hooks
only where one is registered (Triton 3.6 keeps an empty hook chain otherwise, and builds launch
metadata for it on every launch); host code computes grids with :func:`cdiv` and
:func:`next_power_of_2` (Triton's are constexpr-function objects, slow to call on the host).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from tpinv.kernels.descriptors import TensorDescriptor, expand_descriptors, expander, on_cuda_context

try:
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
except ImportError:          # Triton without the 3.4+ runtime knobs: always launch through Triton
    _knobs = None

__all__ = ["launch", "launch_with", "run_entry", "cdiv", "next_power_of_2", "bound_launches", "direct_launches",
           "direct_available", "is_bound", "operands_key", "remember", "rows_2d", "BIND",
           "REUSE_DESCRIPTORS", "DIRECT", "RECORDER"]

#: ``[True]``: reuse bound launchers; ``[False]``: every launch through Triton (tests compare).
BIND = [True]
#: ``[True]``: bound launches reuse TMA descriptors per address
#: (:func:`tpinv.kernels.descriptors.reused_descriptor`);
#: ``[False]``: build them every call (benchmarks compare).
REUSE_DESCRIPTORS = [True]

#: ``[True]``: a bound launch calls the compiled launcher's C entry with the arguments Triton's
#: wrapper would build (:func:`_direct_entry`); ``[False]``: through the wrapper (tests compare).
DIRECT = [True]

#: ``[None]``, or a recorder told of every launch (:class:`tpinv.ops.replay.Recording`): its
#: ``launch(entry, grid, full)`` gets each bound launch's kept entry, grid and arguments (the
#: constexpr tail appended), its ``unbound(fn)`` each launch that went through Triton unbound.
RECORDER: list = [None]

#: Entries a table of bound launchers or launch plans keeps before it is cleared and refilled
#: (shapes that keep changing, e.g. a decode's cache length, would otherwise grow it forever).
MAX_BOUND = 4096

_BOUND: dict = {}        # (device, (id(kernel), key)) -> (compiled kernel, constexpr tail, direct entry, kernel)
_NAMES: dict = {}        # kernel -> its parameter names and defaults
_COUNT = [0]
_DIRECT_COUNT = [0]


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, t.shape[-1]]`` with a unit last stride: a view where one exists, else a
    copy (exact) -- the row layout the row-wise kernels index by one row stride."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def cdiv(x: int, y: int) -> int:
    """``triton.cdiv`` for host code (Triton's is a constexpr function: ~2 us a call on the host)."""
    return (x + (y - 1)) // y


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code: the smallest power of two >= ``n`` (same bit steps)."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    return n + 1


def operands_key(*tensors: torch.Tensor) -> tuple:
    """Shape, strides, dtype, 16-byte alignment and device of each tensor: what a launch plan made
    for them depends on (with the caller's own settings)."""
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % 16 == 0, t.device) for t in tensors)


def remember(table: dict, key, value):
    """``table[key] = value`` (the table cleared first when it holds :data:`MAX_BOUND` entries); returns value."""
    if len(table) >= MAX_BOUND:
        table.clear()
    table[key] = value
    return value


def bound_launches() -> int:
    """How many launches so far went through a bound launcher (tests assert it moves)."""
    return _COUNT[0]


def direct_launches() -> int:
    """How many bound launches so far called the launcher's C entry directly (tests assert it moves)."""
    return _DIRECT_COUNT[0]


def direct_available() -> bool:
    """Whether this Triton's launcher has the form direct launches need (:data:`DIRECT`)."""
    return _knobs is not None and expander() is not None


def is_bound(bound: dict) -> bool:
    """Whether a launch with this plan's ``bound`` dict will call a bound launcher (binding on,
    and a launcher bound for the current device) and may take reused TMA descriptors, which only
    such a launch reads (:data:`REUSE_DESCRIPTORS`)."""
    return (bool(bound) and BIND[0] and REUSE_DESCRIPTORS[0] and _knobs is not None
            and _current_device() in bound)


def _specialization(args: tuple) -> tuple:
    """The key of ``args``: tensors by dtype and 16-byte alignment, ints and None by value, bools
    tagged (Triton compiles bools apart from ints), floats by type, host TMA descriptors by
    dtype, block shape and padding where it has one (Triton 3.6 keys them by dtype and block
    shape).  Raises TypeError for anything else (the launch then goes through Triton)."""
    key = []
    for a in args:
        t = type(a)
        if t is _TENSOR or t is _PARAMETER:
            key.append((a.dtype, not a.data_ptr() & 15))
        elif t is int or a is None:
            key.append(a)
        elif t is bool:
            key.append((bool, a))
        elif t is float:
            key.append(float)
        elif t is TensorDescriptor:
            key.append((TensorDescriptor, a.base.dtype, tuple(a.block_shape), getattr(a, "padding", None)))
        else:
            raise TypeError(t)
    return tuple(key)


_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter


def _parameters(fn) -> tuple:
    params = _NAMES.get(fn)
    if params is None:
        sig = inspect.signature(fn.fn)
        params = _NAMES[fn] = tuple((p.name, p.default) for p in sig.parameters.values())
    return params


def _interpreting(fn) -> bool:
    return not hasattr(fn, "device_caches") or type(fn).__name__ == "InterpretedFunction"


def launch(fn, grid: tuple, *args, bound: Optional[dict] = None, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)``, through a bound launcher when this specialization ran before.

    ``args`` are the kernel's leading (runtime) arguments, ``kwargs`` its constexprs and launch
    options.  ``bound`` (optional) is a dict the caller keeps with a launch plan that fixes every
    integer argument and constexpr and every tensor's dtype and alignment; the bound launcher is
    stored there per device (no key is built, no table looked up)."""
    launch_with(fn, grid, args, kwargs, bound)


def launch_with(fn, grid: tuple, args: tuple, kwargs: dict, bound: Optional[dict] = None) -> None:
    """:func:`launch` with the arguments as a tuple and the constexprs as a dict (a launch plan
    keeps its constexprs' dict and passes it as is)."""
    recorder = RECORDER[0]
    if not BIND[0] or _knobs is None or _interpreting(fn):
        if recorder is not None:
            recorder.unbound(fn)
        on_cuda_context(lambda: fn[grid](*args, **kwargs))
        return
    key = None
    if bound is None:
        try:
            key = (id(fn), _specialization(args), tuple(kwargs.items()))
        except TypeError:        # an argument kind this module does not key: Triton decides
            if recorder is not None:
                recorder.unbound(fn)
            on_cuda_context(lambda: fn[grid](*args, **kwargs))
            return
    device = _current_device()
    entry = _BOUND.get((device, key)) if bound is None else bound.get(device)
    if entry is None:
        entry = _bind(fn, grid, args, kwargs, bound, device, key)
        if recorder is not None and entry is None:
            recorder.unbound(fn)
        elif recorder is not None:
            recorder.launch(entry, grid, (*args, *entry[1]))
        return
    full = (*args, *entry[1])
    if recorder is not None:
        recorder.launch(entry, grid, full)
    if run_entry(entry, grid, full, device):
        _DIRECT_COUNT[0] += 1
    _COUNT[0] += 1


def run_entry(entry: tuple, grid: tuple, full: tuple, device: int) -> bool:
    """Launch a kept entry's compiled kernel (``(compiled, constexpr tail, direct entry, ...)``,
    as :func:`_bind` keeps them) over ``full`` (its runtime arguments, then the tail) on
    ``device``'s current stream: through its launcher's C entry where it has one (:data:`DIRECT`),
    else through its launcher; Triton's launch hooks passed where one is registered.  Returns
    whether the C entry ran.  No table is read and no key built: the caller found the entry."""
    compiled, _, direct = entry[:3]
    stream = _current_stream(device)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    enter, leave = _hooks()
    metadata = compiled.launch_metadata(grid, stream, *full) if enter is not None else None
    if direct is not None and DIRECT[0]:
        c_launch, cooperative, pdl, descriptors = direct
        if descriptors:
            full = expand_descriptors(full, descriptors)
        c_launch(grid[0], g1, g2, stream, compiled.function, cooperative, pdl, None, None,
                 compiled.packed_metadata, metadata, enter, leave, *full)
        return True
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, metadata,
                 enter, leave, *full)
    return False


def _bind(fn, grid: tuple, args: tuple, kwargs: dict, bound: Optional[dict], device: int, key) -> Optional[tuple]:
    """The first launch of a specialization: through Triton, then its compiled kernel is kept (in
    ``bound`` per device, or in the module's table under ``key``) unless it cannot be bound.
    Returns the kept entry, or None."""
    compiled = on_cuda_context(lambda: fn[grid](*args, **kwargs))
    params = _parameters(fn)
    if compiled is None or fn.pre_run_hooks or len(args) > len(params):
        return None
    tail = []
    for name, default in params[len(args):]:
        if name in kwargs:
            tail.append(kwargs[name])
        elif default is not inspect.Parameter.empty:
            tail.append(default)
        else:
            return None              # a runtime argument passed by keyword: not bound
    entry = (compiled, tuple(tail), _direct_entry(compiled), fn)   # fn kept alive: the key holds id(fn)
    if bound is not None:
        bound[device] = entry
    else:
        remember(_BOUND, (device, key), entry)
    return entry


def _hooks() -> tuple:
    """Triton's launch enter and exit hooks, each None where it is an empty hook chain (Triton 3.5+
    keeps a chain object that is never None; calling an empty one does nothing, and the launch
    metadata exists only for an enter hook)."""
    return _active(_knobs.runtime.launch_enter_hook), _active(_knobs.runtime.launch_exit_hook)


def _active(hook):
    """``hook``, or None where it is None or an empty hook chain."""
    if hook is not None and type(hook).__name__ == "HookChain" and not hook.calls:
        return None
    return hook


def _current_device() -> int:
    """The current CUDA device's index, as Triton's driver reads it (its ``get_current_device``)."""
    if not _GETTERS:
        _GETTERS.extend(_getters())
    return _GETTERS[0]()


def _current_stream(device: int) -> int:
    """The current stream of ``device``, as Triton's driver reads it (its ``get_current_stream``)."""
    return _GETTERS[1](device)


def _getters() -> tuple:
    """Triton's device and stream getters, read once; ``torch._C._cuda_getDevice`` where the
    driver's device getter is ``torch.cuda.current_device`` (the same value once CUDA is
    initialized, which it is here: a launch has CUDA tensors)."""
    active = _driver.active
    device = active.get_current_device
    if device is torch.cuda.current_device and hasattr(torch._C, "_cuda_getDevice"):
        torch.cuda.init()
        device = torch._C._cuda_getDevice
    return device, active.get_current_stream


_GETTERS: list = []   # [device getter, stream getter], resolved on the first launch


def _direct_entry(compiled) -> Optional[tuple]:
    """``(C entry, cooperative, pdl, ((position, descriptor metadata), ...))`` of a compiled kernel
    whose launcher is a ``CudaLauncher`` of Triton 3.6's form needing no scratch memory; None otherwise
    (the launch then goes through ``compiled.run``)."""
    run = compiled.run
    if (type(run).__name__ != "CudaLauncher" or not direct_available()
            or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl")):
        return None
    entry = run.launch
    if type(entry).__name__ == "builtin_function_or_method":     # no tensor descriptor argument
        return entry, run.launch_cooperative_grid, run.launch_pdl, ()
    code = getattr(entry, "__code__", None)
    if (getattr(entry, "__name__", "") != "inner" or code is None
            or set(code.co_freevars) != {"launcher", "tensordesc_indices", "tensordesc_meta"}):
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in entry.__closure__)))
    positions = sorted(cells["tensordesc_indices"])
    metas = list(cells["tensordesc_meta"] or [None] * len(positions))
    if len(metas) != len(positions) or type(cells["launcher"]).__name__ != "builtin_function_or_method":
        return None
    return cells["launcher"], run.launch_cooperative_grid, run.launch_pdl, tuple(zip(positions, metas))


