"""CUDA kernels for the ``tpinv::`` ops that have no dedicated GPU kernel: their own torch code.

Invariant kept: every reduction on CUDA runs in the order the CPU path uses, because the
CUDA slot runs the very function the CPU slot runs (products, exact adds in the fixed
halving / leaf-tree order of :mod:`tpinv.kernels.cpu_tree`, ``exp``/``log``/``rsqrt``/
``cos``/``sin``, ``amax``, indexing).  Each of those is a CUDA elementwise (or exact)
kernel that computes an element with the same instruction sequence wherever the element
sits in its tensor, so a row's bits do not depend on batch size, padding or TP size;
``tests/gpu/test_cuda_ops.py`` checks this on the device.  CPU and CUDA bits may differ
(the transcendental functions are different implementations); the order is the same.

Cost: each op becomes many small CUDA launches (one per halving step and per elementwise
op).  This is correct, not fast; a Triton kernel per op is future work.  Ops that already
have a CUDA kernel (the Triton contract matmul) keep it: only placeholders are replaced.
"""
from __future__ import annotations

from typing import Callable

from tpinv.kernels.cpu_attention import attention_forward
from tpinv.kernels.cpu_attention_bwd import attention_backward
from tpinv.ops.activation import silu_mul_backward_op, silu_mul_op
from tpinv.ops.attention import attention_backward_op, attention_op
from tpinv.ops.embedding import embedding_backward_op, embedding_op
from tpinv.ops.linear import tree_sum_op
from tpinv.ops.norm import rms_norm_backward_op, rms_norm_op
from tpinv.ops.registry import has_cuda_kernel, register_cuda_kernel
from tpinv.ops.rope import apply_rope_backward_op, apply_rope_op
from tpinv.ops.softmax import (
    log_softmax_backward_op, log_softmax_op, logsumexp_backward_op, logsumexp_op, softmax_backward_op,
    softmax_op, sum_exp_partial_op,
)

__all__ = ["TORCH_CUDA_OPS", "register_torch_cuda_kernels"]

#: Ops defined with :func:`tpinv.ops.registry.define_op` whose CUDA slot gets their torch code.
TORCH_CUDA_OPS = (
    silu_mul_op, silu_mul_backward_op,
    embedding_op, embedding_backward_op,
    tree_sum_op,
    rms_norm_op, rms_norm_backward_op,
    apply_rope_op, apply_rope_backward_op,
    softmax_op, log_softmax_op, logsumexp_op,
    softmax_backward_op, log_softmax_backward_op, logsumexp_backward_op,
    sum_exp_partial_op,
)


def _torch_impl(op) -> Callable:
    """The Python function ``op`` was defined from (what its CPU slot runs)."""
    fn = getattr(op, "_init_fn", None)
    if not callable(fn):
        raise TypeError(f"{op!r}: expected a torch.library custom op built from a Python function")
    return fn


def _attention_cuda(q, k, v, q_pos, mask, causal, window, scale):
    return attention_forward(q, k, v, q_pos, mask, causal, window, scale)


def _attention_backward_cuda(grad_out, grad_lse, q, k, v, out, lse, q_pos, mask, causal, window,
                             scale):
    return attention_backward(grad_out, grad_lse, q, k, v, out, lse, q_pos, mask,
                                        causal, window, scale)


def register_torch_cuda_kernels() -> list[str]:
    """Fill each still-empty CUDA slot with the op's torch code; returns the ops filled."""
    filled = []
    for op in TORCH_CUDA_OPS:
        if not has_cuda_kernel(op):
            register_cuda_kernel(op, _torch_impl(op))
            filled.append(op._qualname)
    attention_op.register_kernel("cuda", _attention_cuda)
    attention_backward_op.register_kernel("cuda", _attention_backward_cuda)
    filled += ["tpinv::attention", "tpinv::attention_backward"]
    return filled


register_torch_cuda_kernels()
