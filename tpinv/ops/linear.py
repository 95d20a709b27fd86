"""``tpinv::matmul_partial``, ``tpinv::matmul`` and ``tpinv::tree_sum``: invariant linear algebra.

All three keep the contract's order (:mod:`tpinv.kernels.reference_matmul`,
:mod:`tpinv.kernels.reference_tree`): a reduction over a dimension that parallelism may
split is cut into ``leaves`` equal leaves, each reduced by its fixed chain, the leaf
results combined by the adjacent-pair tree, in fp32.  ``matmul_partial`` is a rank's
fp32 partial (its ``leaves`` are the rank's share of the global leaves); ``matmul``
rounds it once to the input dtype and differentiates with the same order:
``dX`` reduces over N with ``grad_leaves`` leaves, ``dW`` over the flattened tokens in
one fixed chain.  On CUDA the matmuls run the contract kernels
(:mod:`tpinv.kernels.matmul_route`); nothing falls back to BLAS.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tpinv.core.contract import DEFAULT_LEAVES, SUPPORTED_DTYPES, check_divisible, check_leaves
from tpinv.kernels import reference_matmul
from tpinv.kernels.reference_tree import leaf_tree_sum
from tpinv.ops.registry import define_op, lazy_kernel, register_fake

__all__ = ["matmul", "matmul_partial", "tree_sum", "matmul_op", "matmul_partial_op", "tree_sum_op"]


def _check_matmul(x, w, leaves, grad_leaves) -> None:
    reference_matmul.check_matmul_inputs(x, w, leaves)
    _check_grad_leaves(grad_leaves)


def _matmul_cuda(x: Tensor, w: Tensor, leaves: int, grad_leaves: int) -> Tensor:
    """The CUDA slot of ``tpinv::matmul``: the Triton contract kernel rounded once (its entry checks
    x, w and leaves; ``grad_leaves`` is checked here, as the CPU kernel does)."""
    _check_grad_leaves(grad_leaves)
    return _matmul_kernel(x, w, leaves)


_matmul_kernel = lazy_kernel("matmul_route.matmul_cuda")


@define_op("matmul_partial", cuda="matmul_route.matmul_partial_cuda",
           check=reference_matmul.check_matmul_inputs)
def matmul_partial_op(x: Tensor, w: Tensor, leaves: int) -> Tensor:
    return reference_matmul.matmul_partial(x, w, leaves)


@register_fake(matmul_partial_op)
def _matmul_partial_fake(x, w, leaves):
    return x.new_empty(*x.shape[:-1], w.shape[0], dtype=torch.float32)


@define_op("matmul", cuda=_matmul_cuda, check=_check_matmul)
def matmul_op(x: Tensor, w: Tensor, leaves: int, grad_leaves: int) -> Tensor:
    _check_grad_leaves(grad_leaves)
    return reference_matmul.matmul_partial(x, w, leaves).to(x.dtype)


@register_fake(matmul_op)
def _matmul_fake(x, w, leaves, grad_leaves):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def _check_grad_leaves(grad_leaves: int) -> None:
    try:
        check_leaves(grad_leaves)
    except ValueError as err:
        raise type(err)(f"grad_leaves: {err}") from None


def _matmul_setup_context(ctx, inputs, output):
    x, w, leaves, grad_leaves = inputs
    if x.requires_grad:
        # dX reduces over N with grad_leaves leaves: fail now, not in the backward pass.
        check_divisible("N (the output size, reduced by dX)", w.shape[0], grad_leaves, "grad_leaves")
    ctx.save_for_backward(x, w)
    ctx.grad_leaves = grad_leaves


def _matmul_backward(ctx, grad):
    x, w = ctx.saved_tensors
    grad = grad.to(x.dtype)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = matmul_op(grad, w.t(), ctx.grad_leaves, 1)     # rounded once (in the epilogue on CUDA)
    if ctx.needs_input_grad[1]:
        n, k = w.shape
        dw = matmul_op(grad.reshape(-1, n).t(), x.reshape(-1, k).t(), 1, 1)
    return dx, dw, None, None


matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup_context)


def _check_tree_sum_input(x: Tensor, leaves: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"tree_sum input dtype {x.dtype} is not supported; use one of {names}")
    if x.dim() < 1:
        raise ValueError("tree_sum reduces the last dim: expected shape [..., n], got a scalar")
    check_leaves(leaves)
    check_divisible("the reduced (last) dimension", x.shape[-1], leaves)


def _tree_sum(x: Tensor, leaves: int) -> Tensor:
    _check_tree_sum_input(x, leaves)
    out = leaf_tree_sum(x.float(), leaves)
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        out = out.clone()   # a one-element reduction is a view; an op's output may not alias
    return out


_halving_sum_kernel = lazy_kernel("triton_tree.halving_sum_cuda")


def _tree_sum_cuda(x: Tensor, leaves: int) -> Tensor:
    """One leaf (the token sums of weight and bias gradients): the halving sum in one launch that
    reads ``x``'s dtype and widens each value to fp32 as it adds -- the adds of the reference on
    ``x.float()``, without the fp32 copy's launch.  More leaves: the reference's torch code."""
    if leaves != 1:
        return _tree_sum(x, leaves)
    _check_tree_sum_input(x, leaves)
    return _halving_sum_kernel(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1])


@define_op("tree_sum", cuda=_tree_sum_cuda, check=_check_tree_sum_input)
def tree_sum_op(x: Tensor, leaves: int) -> Tensor:
    return _tree_sum(x, leaves)


@register_fake(tree_sum_op)
def _tree_sum_fake(x, leaves):
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


def _tree_sum_setup_context(ctx, inputs, output):
    x, _ = inputs
    ctx.shape, ctx.dtype = x.shape, x.dtype


def _tree_sum_backward(ctx, grad):
    # d(sum)/dx_i = 1: the gradient is broadcast, no reduction and no rounding but the cast.
    return grad.unsqueeze(-1).expand(ctx.shape).to(ctx.dtype).contiguous(), None


tree_sum_op.register_autograd(_tree_sum_backward, setup_context=_tree_sum_setup_context)


def matmul_partial(x: Tensor, w: Tensor, leaves: int = DEFAULT_LEAVES) -> Tensor:
    """fp32 ``[..., N]`` partial of ``x [..., K] @ w[N, K]^T`` in the contract's order.

    ``K`` is cut into ``leaves`` leaves (a power of two dividing ``K``); for a rank holding
    ``K/C`` of the columns pass ``leaves = L // C`` and combine the ``C`` partials with
    :func:`tpinv.core.contract.tree_combine`.  Same dtype for ``x`` and ``w`` (fp32, bf16, fp16).
    No autograd: a building block for layers that route partials themselves.
    """
    return matmul_partial_op(x, w, leaves)


def matmul(x: Tensor, w: Tensor, leaves: int = DEFAULT_LEAVES,
           grad_leaves: int = DEFAULT_LEAVES) -> Tensor:
    """``x [..., K] @ w[N, K]^T`` in ``x.dtype``: :func:`matmul_partial` rounded once.

    Differentiable: ``dX`` is the contract's reduction over N with ``grad_leaves`` leaves
    (``N`` must divide by it when ``x`` needs a gradient), ``dW`` a fixed chain over the
    flattened tokens; both rounded once.
    """
    return matmul_op(x, w, leaves, grad_leaves)


def tree_sum(x: Tensor, leaves: int = DEFAULT_LEAVES) -> Tensor:
    """fp32 sum of the last dim of ``x [..., n]`` in the contract's order (``n % leaves == 0``).

    ``leaves=1`` is the fixed chain for dimensions no parallelism splits (e.g. tokens in
    a bias gradient); its zero padding makes it independent of trailing zero padding.
    """
    return tree_sum_op(x, leaves)

