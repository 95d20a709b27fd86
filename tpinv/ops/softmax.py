"""``tpinv::softmax``, ``tpinv::log_softmax``, ``tpinv::logsumexp``, ``tpinv::sum_exp_partial``.

torch.library custom ops over :mod:`tpinv.kernels.reference_softmax`: the row max is exact and
the one sum over the last dim (which may be a tensor-parallel vocabulary) follows the
contract with ``leaves`` leaves, forward and backward.  The split pieces
(``sum_exp_partial`` and the ``*_from_parts`` functions) compose over ``C`` ranks to the
same bits as the unsplit ops; the recipe is in the kernel module's docstring.  On CUDA the
forwards run the Triton kernels of :mod:`tpinv.kernels.triton_softmax`, the backwards the same
fixed-order torch code as on the CPU (named in the op definitions below).
"""
from __future__ import annotations

import torch
from torch import Tensor

from tpinv.core.contract import DEFAULT_LEAVES
from tpinv.kernels import reference_softmax as kern
from tpinv.ops.registry import REFERENCE, define_op, register_fake

__all__ = ["softmax", "log_softmax", "logsumexp", "sum_exp_partial",
           "logsumexp_from_parts", "log_softmax_from_parts", "softmax_from_parts",
           "softmax_op", "log_softmax_op", "logsumexp_op", "sum_exp_partial_op",
           "softmax_backward_op", "log_softmax_backward_op", "logsumexp_backward_op",
           "sum_exp_partial_backward_op"]


def _row_check(name: str):
    def check(x, leaves) -> None:
        kern.check_softmax_inputs(x, leaves, name)
    return check


def _row_backward_check(name: str):
    def check(grad, x, leaves) -> None:
        kern.check_softmax_inputs(x, leaves, name)
    return check


@define_op("softmax", cuda="triton_softmax.softmax_forward_cuda", check=_row_check("softmax"))
def softmax_op(x: Tensor, leaves: int) -> Tensor:
    return kern.softmax_forward(x, leaves)


@define_op("log_softmax", cuda="triton_softmax.log_softmax_forward_cuda", check=_row_check("log_softmax"))
def log_softmax_op(x: Tensor, leaves: int) -> Tensor:
    return kern.log_softmax_forward(x, leaves)


@define_op("logsumexp", cuda="triton_softmax.logsumexp_forward_cuda", check=_row_check("logsumexp"))
def logsumexp_op(x: Tensor, leaves: int) -> Tensor:
    return kern.logsumexp_forward(x, leaves)


@define_op("softmax_backward", cuda=REFERENCE, check=_row_backward_check("softmax"))
def softmax_backward_op(grad: Tensor, x: Tensor, leaves: int) -> Tensor:
    return kern.softmax_backward(grad, x, leaves)


@define_op("log_softmax_backward", cuda=REFERENCE, check=_row_backward_check("log_softmax"))
def log_softmax_backward_op(grad: Tensor, x: Tensor, leaves: int) -> Tensor:
    return kern.log_softmax_backward(grad, x, leaves)


@define_op("logsumexp_backward", cuda=REFERENCE, check=_row_backward_check("logsumexp"))
def logsumexp_backward_op(grad: Tensor, x: Tensor, leaves: int) -> Tensor:
    return kern.logsumexp_backward(grad, x, leaves)


@define_op("sum_exp_partial", cuda="triton_softmax.sum_exp_partial_cuda", check=kern.check_partial_inputs)
def sum_exp_partial_op(x: Tensor, max: Tensor, leaves: int) -> Tensor:
    return kern.sum_exp_partial(x, max, leaves)


_ROW_OPS = {
    "softmax": (softmax_op, softmax_backward_op, False),
    "log_softmax": (log_softmax_op, log_softmax_backward_op, False),
    "logsumexp": (logsumexp_op, logsumexp_backward_op, True),
}


def _register(name: str, op, backward_op, reduces: bool) -> None:
    def fake(x, leaves):
        return x.new_empty(x.shape[:-1] if reduces else x.shape)

    def backward_fake(grad, x, leaves):
        return torch.empty_like(x)

    def setup_context(ctx, inputs, output):
        x, leaves = inputs
        ctx.save_for_backward(x)
        ctx.leaves = leaves

    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return backward_op(grad, x, ctx.leaves), None

    register_fake(op)(fake)
    register_fake(backward_op)(backward_fake)
    op.register_autograd(backward, setup_context=setup_context)


for _name, (_op, _backward_op, _reduces) in _ROW_OPS.items():
    _register(_name, _op, _backward_op, _reduces)


@register_fake(sum_exp_partial_op)
def _sum_exp_partial_fake(x, max, leaves):
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


def _check_partial_backward(grad, x, max) -> None:
    kern.check_partial_inputs(x, max, 1)
    if tuple(grad.shape) != tuple(max.shape):
        raise ValueError(f"sum_exp_partial grad must have the row shape {list(max.shape)}, got {list(grad.shape)}")


@define_op("sum_exp_partial_backward", cuda=REFERENCE, check=_check_partial_backward)
def sum_exp_partial_backward_op(grad: Tensor, x: Tensor, max: Tensor) -> Tensor:
    """``grad * exp(x - max)`` in ``x.dtype`` (an op, so torch.compile runs the eager ``exp``)."""
    shifted = x.to(torch.float32) - kern.safe_shift(max).unsqueeze(-1)
    return (grad.to(torch.float32).unsqueeze(-1) * torch.exp(shifted)).to(x.dtype)


@register_fake(sum_exp_partial_backward_op)
def _sum_exp_partial_backward_fake(grad, x, max):
    return torch.empty_like(x)


def _partial_setup_context(ctx, inputs, output):
    x, max_, leaves = inputs
    ctx.save_for_backward(x, max_)


def _partial_backward(ctx, grad):
    x, max_ = ctx.saved_tensors
    return sum_exp_partial_backward_op(grad, x, max_), None, None


sum_exp_partial_op.register_autograd(_partial_backward, setup_context=_partial_setup_context)


def softmax(x: Tensor, leaves: int = DEFAULT_LEAVES) -> Tensor:
    """Invariant softmax over the last dim (``x.shape[-1]`` divisible by ``leaves``)."""
    return softmax_op(x, leaves)


def log_softmax(x: Tensor, leaves: int = DEFAULT_LEAVES) -> Tensor:
    """Invariant log-softmax over the last dim (``x.shape[-1]`` divisible by ``leaves``)."""
    return log_softmax_op(x, leaves)


def logsumexp(x: Tensor, leaves: int = DEFAULT_LEAVES) -> Tensor:
    """Invariant logsumexp over the last dim: shape ``x.shape[:-1]``, dtype ``x.dtype``."""
    return logsumexp_op(x, leaves)


def sum_exp_partial(x: Tensor, max: Tensor, leaves: int) -> Tensor:
    """fp32 sub-tree partial ``sum(exp(x - max))`` of this rank's slice of the last dim.

    ``max`` is the fp32 row max over the whole row (shape ``x.shape[:-1]``), ``leaves`` the
    leaves this rank owns (``L // C``).  ``max`` is treated as a constant: it gets no
    gradient (the exact gradient of ``logsumexp`` through it is zero).
    """
    return sum_exp_partial_op(x, max, leaves)


logsumexp_from_parts = kern.logsumexp_from_parts
log_softmax_from_parts = kern.log_softmax_from_parts
softmax_from_parts = kern.softmax_from_parts
