"""The CUDA slots of the ``tpinv::`` ops: Triton kernels, and fixed-order torch code for the rest.

Invariant kept: a row's bits on CUDA do not depend on batch size, padding or TP size.  The
Triton kernels (:data:`TRITON_CUDA_KERNELS`: RMSNorm, the softmax family's forward,
SiLU-and-mul, RoPE; attention forward and backward below) each state the order they fix in
their module.  The remaining ops (:data:`TORCH_CUDA_OPS`: embedding, the tree sum, the
softmax-family backward) run the very function their CPU slot runs -- products and exact adds
in the fixed halving / leaf-tree order of :mod:`tpinv.kernels.cpu_tree`, elementwise CUDA
kernels that compute an element the same way wherever it sits -- so their order is the CPU
order (the bits may differ from the CPU: other transcendental implementations).
``tests/gpu/`` checks every slot on the device.  The contract matmul registers its own Triton
kernel (:mod:`tpinv.ops.linear`); only empty slots are filled here.  Triton is imported when a
kernel first runs.
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
