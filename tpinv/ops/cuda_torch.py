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
op).  This is correct, not fast.  Ops that already have a CUDA kernel (the Triton contract
matmul) keep it: only placeholders are replaced.  ``sum_exp_partial``, softmax, log-softmax
and logsumexp (forward) get Triton kernels with a fixed per-leaf order instead
(:mod:`tpinv.kernels.triton_softmax`); triton is imported only when one of them runs.
The RMSNorm Triton kernels (:mod:`tpinv.kernels.triton_norm`, wrapped below) are not
registered until their fixed version has passed ``tests/gpu/test_triton_norm_softmax.py``.
"""
from __future__ import annotations

from typing import Callable

from tpinv.ops.activation import silu_mul_backward_op, silu_mul_op
from tpinv.ops.attention import attention_backward_op, attention_op
from tpinv.ops.embedding import embedding_backward_op, embedding_op
from tpinv.ops.linear import tree_sum_op
from tpinv.ops.norm import rms_norm_backward_heads_op, rms_norm_backward_op, rms_norm_op
from tpinv.ops.registry import has_cuda_kernel, register_cuda_kernel
from tpinv.ops.rope import apply_rope_backward_op, apply_rope_op
from tpinv.ops.softmax import (
    log_softmax_backward_op, log_softmax_op, logsumexp_backward_op, logsumexp_op, softmax_backward_op,
    softmax_op, sum_exp_partial_op,
)

__all__ = ["TORCH_CUDA_OPS", "TRITON_CUDA_KERNELS", "register_torch_cuda_kernels"]

#: Ops defined with :func:`tpinv.ops.registry.define_op` whose CUDA slot gets their torch code.
#: (The ops in :data:`TRITON_CUDA_KERNELS` get a Triton kernel instead.)
TORCH_CUDA_OPS = (
    embedding_op, embedding_backward_op,
    tree_sum_op,
    softmax_backward_op, log_softmax_backward_op, logsumexp_backward_op,
)


def _torch_impl(op) -> Callable:
    """The Python function ``op`` was defined from (what its CPU slot runs)."""
    fn = getattr(op, "_init_fn", None)
    if not callable(fn):
        raise TypeError(f"{op!r}: expected a torch.library custom op built from a Python function")
    return fn


def _attention_triton(q, k, v, q_pos, mask, causal, window, scale):
    from tpinv.kernels.triton_attention import attention_forward_cuda
    return attention_forward_cuda(q, k, v, q_pos, mask, causal, window, scale)


def _attention_backward_triton(grad_out, grad_lse, q, k, v, out, lse, q_pos, mask, causal, window,
                               scale):
    from tpinv.kernels.triton_attention_bwd import attention_backward_cuda
    return attention_backward_cuda(grad_out, grad_lse, q, k, v, out, lse, q_pos, mask, causal,
                                   window, scale)


def _rms_norm_triton(x, weight, eps):
    from tpinv.kernels.triton_norm import rms_norm_forward_cuda
    return rms_norm_forward_cuda(x, weight, eps)


def _rms_norm_backward_triton(grad, x, weight, eps):
    from tpinv.kernels.triton_norm import rms_norm_backward_cuda
    return rms_norm_backward_cuda(grad, x, weight, eps)


def _rms_norm_backward_heads_triton(grad, x, weight, eps):
    from tpinv.kernels.triton_norm import rms_norm_backward_heads_cuda
    return rms_norm_backward_heads_cuda(grad, x, weight, eps)


def _silu_mul_triton(gate, up):
    from tpinv.kernels.triton_elementwise import silu_mul_forward_cuda
    return silu_mul_forward_cuda(gate, up)


def _silu_mul_backward_triton(grad, gate, up):
    from tpinv.kernels.triton_elementwise import silu_mul_backward_cuda
    return silu_mul_backward_cuda(grad, gate, up)


def _apply_rope_triton(x, cos, sin):
    from tpinv.kernels.triton_elementwise import apply_rope_forward_cuda
    return apply_rope_forward_cuda(x, cos, sin)


def _apply_rope_backward_triton(grad, cos, sin):
    from tpinv.kernels.triton_elementwise import apply_rope_backward_cuda
    return apply_rope_backward_cuda(grad, cos, sin)


def _sum_exp_partial_triton(x, max, leaves):
    from tpinv.kernels.triton_softmax import sum_exp_partial_cuda
    return sum_exp_partial_cuda(x, max, leaves)


def _softmax_triton(x, leaves):
    from tpinv.kernels.triton_softmax import softmax_forward_cuda
    return softmax_forward_cuda(x, leaves)


def _log_softmax_triton(x, leaves):
    from tpinv.kernels.triton_softmax import log_softmax_forward_cuda
    return log_softmax_forward_cuda(x, leaves)


def _logsumexp_triton(x, leaves):
    from tpinv.kernels.triton_softmax import logsumexp_forward_cuda
    return logsumexp_forward_cuda(x, leaves)


#: (op, Triton-backed CUDA kernel) pairs registered ahead of the torch code.
TRITON_CUDA_KERNELS = (
    (sum_exp_partial_op, _sum_exp_partial_triton),
    (softmax_op, _softmax_triton),
    (log_softmax_op, _log_softmax_triton),
    (logsumexp_op, _logsumexp_triton),
    (rms_norm_op, _rms_norm_triton),
    (rms_norm_backward_op, _rms_norm_backward_triton),
    (rms_norm_backward_heads_op, _rms_norm_backward_heads_triton),
    (silu_mul_op, _silu_mul_triton),
    (silu_mul_backward_op, _silu_mul_backward_triton),
    (apply_rope_op, _apply_rope_triton),
    (apply_rope_backward_op, _apply_rope_backward_triton),
)


def register_torch_cuda_kernels() -> list[str]:
    """Fill each still-empty CUDA slot (Triton kernels first, then the op's torch code)."""
    filled = []
    for op, kernel in TRITON_CUDA_KERNELS:
        if not has_cuda_kernel(op):
            register_cuda_kernel(op, kernel)
            filled.append(op._qualname)
    for op in TORCH_CUDA_OPS:
        if not has_cuda_kernel(op):
            register_cuda_kernel(op, _torch_impl(op))
            filled.append(op._qualname)
    attention_op.register_kernel("cuda", _attention_triton)
    attention_backward_op.register_kernel("cuda", _attention_backward_triton)
    filled += ["tpinv::attention", "tpinv::attention_backward"]
    return filled


register_torch_cuda_kernels()
