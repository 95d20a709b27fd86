"""Defining ``tpinv::`` custom ops: one :func:`define_op` names an op's reference kernel, its
CUDA kernel and its input check.

Every op of the library is a :func:`torch.library.custom_op` in the ``tpinv`` namespace
whose CPU kernel keeps the contract's fixed reduction order.  Its CUDA slot holds the
kernel the definition names -- a Triton kernel imported on first use, or the reference
kernel's own fixed-order torch code -- or a placeholder that raises
:class:`NotImplementedError` naming the op, so a CUDA tensor can never silently reach
cuBLAS (or any order-changing fallback).  Nothing is registered by a side-effect import:
importing an op's module defines it completely (:data:`OPS` lists every definition).

Layout: every kernel slot and every fake returns its outputs in one declared layout -- the
registry puts each kernel's outputs and each fake's in it (a copy, exact, only where a kernel
returned another layout) -- so the strides torch.compile plans with from the fake are the
strides the kernel returns, whatever the layout of the inputs (``tests/unit/test_opcheck.py``
runs ``torch.library.opcheck`` on every op in :data:`OPS`).  The layout is **contiguous**
(row-major) unless the definition names an input per output (``outputs_like``): that output then
has the input's layout where it has a unit last stride
(:func:`tpinv.kernels.layout.empty_in_layout_of`) -- attention and rope hand a ``[B, S, H, D]``
buffer seen as ``[B, H, S, D]`` back in that layout, and their kernels write it directly.

Device: the CUDA slot runs its kernel with its first tensor input's device current
(:func:`on_device_of_inputs`), as torch's own ops do, so tensors on ``cuda:1`` run there and on its
stream whichever device is current.

Eager calls: an op called in plain eager code -- not under ``torch.compile``, no dispatch or
function mode, no profiler, no functorch transform, plain tensors passed positionally -- runs
its kernel directly (through an :class:`torch.autograd.Function` made from the op's own
``register_autograd`` formula when a gradient is needed), skipping the dispatcher's Python
round trip (:class:`InvariantOp`).  It is the same kernel with the same check, so the same
bits (``tests/unit/test_eager_calls.py``); everything else goes through the registered op.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable, Iterable, NamedTuple, Optional, Union

import torch
try:
    from torch.library import CustomOpDef
except ImportError:                      # older torch keeps it private
    from torch._library.custom_ops import CustomOpDef

from tpinv.core.autograd import PLAIN_TENSORS, observed
from tpinv.kernels.layout import in_layout_of

NAMESPACE = "tpinv"


def qualified_name(name: str) -> str:
    """``"matmul"`` -> ``"tpinv::matmul"`` (a qualified name is returned unchanged)."""
    if "::" in name:
        namespace, _, short = name.partition("::")
        if namespace != NAMESPACE or not short:
            raise ValueError(f"op name {name!r} must be '{NAMESPACE}::<name>' or a bare <name>")
        return name
    if not name.isidentifier():
        raise ValueError(f"op name {name!r} must be a Python identifier such as 'matmul'")
    return f"{NAMESPACE}::{name}"


def missing_cuda_kernel(qualname: str) -> Callable:
    """The CUDA-slot placeholder of ``qualname``: raises instead of computing."""

    def no_cuda_kernel(*args, **kwargs):
        raise NotImplementedError(
            f"{qualname} has no CUDA kernel yet; name an invariant one in its define_op(cuda=...) "
            f"(no cuBLAS fallback is used)")

    no_cuda_kernel.__qualname__ = no_cuda_kernel.__name__ = f"no_cuda_kernel[{qualname}]"
    no_cuda_kernel.is_placeholder = True
    return no_cuda_kernel


#: ``cuda=REFERENCE``: the op's reference kernel -- fixed-order torch code -- runs on CUDA too.
REFERENCE = "reference"

#: Every op's definition, by qualified name.
OPS: dict[str, "OpDef"] = {}


def contiguous_outputs(value):
    """``value`` (a tensor, None or a tuple/list of them) with every tensor contiguous."""
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, (tuple, list)):
        return type(value)(contiguous_outputs(v) for v in value)
    return value


def outputs_in_layout(value, args: tuple, likes: Optional[tuple]):
    """``value`` (a tensor or a tuple of them) in the declared layout: output ``i`` in the layout of
    ``args[likes[i]]`` (:func:`tpinv.kernels.layout.in_layout_of`) where ``likes[i]`` is an index,
    contiguous where it is None or ``likes`` is None."""
    if likes is None:
        return contiguous_outputs(value)
    single = isinstance(value, torch.Tensor)
    outs = (value,) if single else value
    placed = tuple(out if out is None else
                   (out.contiguous() if like is None or like >= len(args) or args[like] is None
                    else in_layout_of(out, args[like]))
                   for out, like in zip(outs, likes))
    return placed[0] if single else type(value)(placed)


def on_device_of_inputs(kernel: Callable, tensor_args: tuple) -> Callable:
    """``kernel`` run with its first tensor argument's CUDA device current (the device Triton
    launches on and takes its stream from), where another device is current: tensors on ``cuda:1``
    with ``cuda:0`` current run on ``cuda:1``, in order with its stream, as torch's own ops do."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        if _ONE_CUDA_DEVICE[0] is None:
            _ONE_CUDA_DEVICE[0] = torch.cuda.device_count() <= 1
        if _ONE_CUDA_DEVICE[0]:          # no other device to be on
            return kernel(*args, **kwargs)
        for i in tensor_args:
            t = args[i] if i < len(args) else None
            if t is not None:
                index = t.get_device()
                if index >= 0 and index != torch._C._cuda_getDevice():
                    with torch.cuda.device(index):
                        return kernel(*args, **kwargs)
                break
        return kernel(*args, **kwargs)

    return run


#: ``[None]`` until the first CUDA call, then whether this process sees one CUDA device only.
_ONE_CUDA_DEVICE: list = [None]


def with_outputs_in_layout(kernel: Callable, likes: Optional[tuple] = None) -> Callable:
    """``kernel`` whose outputs are put in the declared layout (:func:`outputs_in_layout`)."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        return outputs_in_layout(kernel(*args, **kwargs), args, likes)

    return run


class _EagerAutograd(torch.autograd.Function):
    """Base of each op's eager autograd function (:meth:`InvariantOp.register_autograd`)."""


class InvariantOp(CustomOpDef):
    """A ``tpinv::`` custom op whose plain eager calls run the kernel directly.

    Same kernel, same input check and same autograd formula as the registered op; the
    dispatcher is skipped only where nothing could observe or transform the call (see the
    module docstring).  :data:`EAGER_CALLS` (``False``) turns the direct path off."""

    def __call__(self, *args, **kwargs):
        fast = self._tpinv_eager
        if kwargs or not EAGER_CALLS[0] or len(args) != fast.arity or observed():
            return self._opoverload(*args, **kwargs)
        cuda = None          # whether the tensor arguments are on CUDA (all) or the CPU (all)
        grad = False
        for i in fast.tensor_args:
            t = args[i]
            if t is None:
                continue
            if type(t) not in PLAIN_TENSORS:
                return self._opoverload(*args)
            on_cuda = t.is_cuda
            if not on_cuda and not t.is_cpu:
                return self._opoverload(*args)        # another device (meta, ...): torch dispatches
            if cuda is None:
                cuda = on_cuda
            elif on_cuda is not cuda:
                return self._opoverload(*args)        # CPU and CUDA mixed: torch dispatches
            if t.requires_grad:
                grad = True
        if cuda is None:
            return self._opoverload(*args)
        kernel = fast.cuda if cuda else fast.cpu
        if grad and fast.autograd is not None and torch.is_grad_enabled():
            if fast.mutates:
                return self._opoverload(*args)
            return fast.autograd.apply(kernel, *args)
        return kernel(*args)

    def register_autograd(self, backward, /, *, setup_context=None):
        super().register_autograd(backward, setup_context=setup_context)

        def forward(ctx, kernel, *args):
            out = kernel(*args)
            if setup_context is not None:
                setup_context(ctx, args, out)
            return out

        def eager_backward(ctx, *grads):
            needs = ctx.needs_input_grad
            ctx.needs_input_grad = needs[1:]  # the formula sees the op's own inputs, not the kernel
            try:
                result = backward(ctx, *grads)
            finally:
                ctx.needs_input_grad = needs
            return (None, *result) if isinstance(result, tuple) else (None, result)

        class_name = f"Eager_{self._name}"
        self._tpinv_eager.autograd = type(class_name, (_EagerAutograd,), {
            "forward": staticmethod(forward), "backward": staticmethod(eager_backward)})


#: ``[True]``: plain eager calls run the kernel directly (:class:`InvariantOp`); ``[False]``: every
#: call goes through the dispatcher (tests compare the two).
EAGER_CALLS = [True]


class _EagerPath:
    """What :meth:`InvariantOp.__call__` needs, computed once per op."""

    def __init__(self, schema, cpu: Callable, cuda: Callable, mutates: bool):
        self.arity = len(schema.arguments)
        self.tensor_args = tensor_positions(schema)
        self.cpu, self.cuda, self.mutates, self.autograd = cpu, cuda, mutates, None


def tensor_positions(schema) -> tuple:
    """Positions of an op schema's tensor arguments (optional ones included, lists not)."""
    return tuple(i for i, a in enumerate(schema.arguments)
                 if "Tensor" in str(a.type) and "[]" not in str(a.type))


class OpDef(NamedTuple):
    """One op in one place: the op, its reference (CPU) kernel, its CUDA kernel and its input check."""
    op: CustomOpDef
    reference: Callable
    cuda: Union[str, Callable, None]
    check: Optional[Callable]
    cuda_kernel: Callable  #: what the CUDA slot holds (resolved from ``cuda``)
    outputs_like: Optional[tuple] = None  #: per output, the input index whose layout it takes


def lazy_kernel(path: str) -> Callable:
    """The CUDA kernel ``tpinv.kernels.<module>.<function>`` named by ``path`` (``"module.function"``),
    imported on its first call, so a CPU-only process never imports Triton."""
    module, _, name = path.rpartition(".")
    if not module or not name:
        raise ValueError(f"CUDA kernel {path!r}: expected '<module in tpinv.kernels>.<function>'")
    resolved: list[Callable] = []

    def kernel(*args, **kwargs):
        if not resolved:
            resolved.append(getattr(importlib.import_module(f"tpinv.kernels.{module}"), name))
        return resolved[0](*args, **kwargs)

    kernel.__qualname__ = kernel.__name__ = path
    kernel.triton_module, kernel.triton_name = f"tpinv.kernels.{module}", name
    return kernel


def define_op(name: str, *, cuda: Union[str, Callable, None], check: Optional[Callable] = None,
              mutates_args: Iterable[str] = (),
              outputs_like: Optional[tuple] = None) -> Callable[[Callable], CustomOpDef]:
    """Decorator: define ``tpinv::<name>`` -- the one place that names all of the op's parts.

    * the decorated function is the **reference kernel** (the CPU slot); its type annotations
      give the schema;
    * ``cuda`` is the **CUDA kernel**: ``"<module>.<function>"`` of :mod:`tpinv.kernels`
      (resolved on first use, :func:`lazy_kernel`), :data:`REFERENCE` (the reference kernel's
      fixed-order torch code runs on CUDA too), an adapter function defined beside the op (when
      the Triton entry's arguments differ from the op's), or ``None`` (the slot raises, never a
      fallback);
    * every kernel's outputs are put in the declared layout (:func:`with_outputs_in_layout`), as
      are the fake's (:func:`register_fake`), so fake and real strides agree: contiguous, or, for
      output ``i``, the layout of the input named ``outputs_like[i]`` (None: contiguous);
    * ``check`` is the op's **input check**, called with the op's arguments.  It runs once per
      call: in the fake (:func:`register_fake`), and at the entry of the kernel that runs --
      the reference and Triton kernels are public entry points (tests and benchmarks call them
      directly), so each validates its own inputs with this same function and the op and the
      public wrapper add no second check (the matmul kernel checks a call signature once: its
      checks are functions of the shapes, dtypes and devices its kept route is keyed by).

    Register autograd (``op.register_autograd``) on the result where the op is differentiable.
    """
    qualname = qualified_name(name)

    def wrap(reference: Callable) -> CustomOpDef:
        if qualname in OPS:
            raise ValueError(f"{qualname} is defined twice")
        mutated = tuple(mutates_args)
        schema = torch.library.infer_schema(reference, mutates_args=mutated)  # from the reference's own hints
        likes = _input_indices(reference, outputs_like)
        reference_slot = with_outputs_in_layout(reference, likes)
        op = torch.library.custom_op(qualname, mutates_args=mutated, device_types="cpu",
                                     schema=schema)(reference_slot)
        if cuda is None:
            kernel = missing_cuda_kernel(qualname)
        elif cuda == REFERENCE:
            kernel = reference
        elif callable(cuda):
            kernel = cuda
        else:
            kernel = lazy_kernel(cuda)
        cuda_slot = on_device_of_inputs(with_outputs_in_layout(kernel, likes),
                                        tensor_positions(op._opoverload._schema))
        op.register_kernel("cuda", cuda_slot)
        op.__class__ = InvariantOp
        op._tpinv_eager = _EagerPath(op._opoverload._schema, reference_slot, cuda_slot, bool(mutated))
        OPS[qualname] = OpDef(op, reference, cuda, check, kernel, likes)
        return op

    return wrap


def register_fake(op: CustomOpDef) -> Callable[[Callable], Callable]:
    """Decorator: the fake (shape-only) kernel of ``op``, run after the op's check; its outputs are
    put in the op's declared layout, the one its kernel slots return (:func:`define_op`)."""
    definition = OPS[_qualname_of(op)]
    check, likes = definition.check, definition.outputs_like

    def wrap(fake: Callable) -> Callable:
        def checked_fake(*args, **kwargs):
            if check is not None:
                check(*args, **kwargs)
            return outputs_in_layout(fake(*args, **kwargs), args, likes)

        op.register_fake(checked_fake)
        return fake

    return wrap


def _input_indices(reference: Callable, names: Optional[tuple]) -> Optional[tuple]:
    """``outputs_like``'s input names as positions in ``reference``'s signature."""
    if names is None:
        return None
    params = list(inspect.signature(reference).parameters)
    unknown = [n for n in names if n is not None and n not in params]
    if unknown:
        raise ValueError(f"outputs_like names {unknown}, not inputs of {reference.__name__}{tuple(params)}")
    return tuple(None if n is None else params.index(n) for n in names)


def _qualname_of(op: CustomOpDef) -> str:
    if not isinstance(op, CustomOpDef):
        raise TypeError(f"expected a tpinv custom op (CustomOpDef), got {type(op).__name__}")
    qualname = op._qualname
    if qualname not in OPS:
        raise ValueError(f"{qualname} was not defined through tpinv.ops.registry.define_op")
    return qualname


def cuda_kernel(op: CustomOpDef) -> Callable:
    """The function in the CUDA slot of ``op`` (the placeholder where its definition names none)."""
    return OPS[_qualname_of(op)].cuda_kernel


def has_cuda_kernel(op: CustomOpDef) -> bool:
    """Whether a real CUDA kernel (not the placeholder) is registered for ``op``."""
    return not getattr(cuda_kernel(op), "is_placeholder", False)
