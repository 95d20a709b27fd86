"""``tpinv::embedding`` and ``tpinv::embedding_backward``: lookup with a fixed-order gradient.

The lookup is exact.  The gradient of each table row is the fp32 chain of its tokens'
gradients in flattened token order, rounded once (:mod:`tpinv.kernels.reference_embedding`),
so a row's gradient bits depend only on its own tokens and their order; a token whose id is
:data:`IGNORED_ID` (-1) adds to no row.  On CUDA the lookup
runs the same torch code and the gradient the Triton token-order chain of
:mod:`tpinv.kernels.triton_embedding`; nothing falls back to an atomic-add scatter.
"""
from __future__ import annotations

from torch import Tensor

from tpinv.kernels import reference_embedding
from tpinv.kernels.reference_embedding import IGNORED_ID
from tpinv.ops.registry import REFERENCE, define_op, register_fake

__all__ = ["embedding", "embedding_backward", "embedding_op", "embedding_backward_op", "IGNORED_ID"]


def _check_embedding(ids, weight) -> None:
    reference_embedding.check_weight(weight)


def _check_embedding_backward(grad, ids, num_rows) -> None:
    if grad.dim() != ids.dim() + 1:
        raise ValueError(f"grad has shape {list(grad.shape)} but ids has shape {list(ids.shape)}: "
                         f"expected grad [*ids.shape, dim]")


@define_op("embedding", cuda=REFERENCE, check=_check_embedding)
def embedding_op(ids: Tensor, weight: Tensor) -> Tensor:
    return reference_embedding.embedding_forward(ids, weight)


@register_fake(embedding_op)
def _embedding_fake(ids, weight):
    return weight.new_empty(*ids.shape, weight.shape[-1])


@define_op("embedding_backward", cuda="triton_embedding.embedding_backward_cuda",
           check=_check_embedding_backward)
def embedding_backward_op(grad: Tensor, ids: Tensor, num_rows: int) -> Tensor:
    return reference_embedding.embedding_backward(grad, ids, num_rows)


@register_fake(embedding_backward_op)
def _embedding_backward_fake(grad, ids, num_rows):
    return grad.new_empty(num_rows, grad.shape[-1])


def _setup_context(ctx, inputs, output):
    ids, weight = inputs
    ctx.save_for_backward(ids)
    ctx.num_rows, ctx.dtype = weight.shape[0], weight.dtype


def _backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    return None, embedding_backward_op(grad.to(ctx.dtype), ids, ctx.num_rows)


embedding_op.register_autograd(_backward, setup_context=_setup_context)


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """``weight[ids]`` (``[*ids.shape, dim]``); the weight gradient sums in token order.

    ``ids`` integer, every value in ``[0, num_rows)`` (else :class:`IndexError` naming the id).
    """
    return embedding_op(ids, weight)


def embedding_backward(grad: Tensor, ids: Tensor, num_rows: int) -> Tensor:
    """``[num_rows, dim]`` in ``grad.dtype``: row ``r`` is ``((0 + g_t1) + g_t2) + ...`` over the
    tokens ``t1 < t2 < ...`` (flattened order) with ``ids[t] == r``, summed in fp32, rounded once.
    """
    return embedding_backward_op(grad, ids, num_rows)
