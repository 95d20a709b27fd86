"""The CUDA slots of the ``tpinv::`` ops: Triton kernels, and fixed-order torch code for the rest.

Invariant kept: a row's bits on CUDA do not depend on batch size, padding or TP size.  The
Triton kernels (:data:`TRITON_CUDA_KERNELS`: RMSNorm, the softmax family's forward,
SiLU-and-mul, RoPE, attention forward and backward, the embedding gradient) each state the
order they fix in their module.  The remaining ops (:data:`TORCH_CUDA_OPS`: the embedding
lookup, the tree sum, the softmax-family backward) run the very function their CPU slot runs -- products and exact adds
in the fixed halving / leaf-tree order of :mod:`tpinv.kernels.reference_tree`, elementwise CUDA
kernels that compute an element the same way wherever it sits -- so their order is the CPU
order (the bits may differ from the CPU: other transcendental implementations).
``tests/gpu/`` checks every slot on the device.  The contract matmul registers its own Triton
kernel (:mod:`tpinv.ops.linear`); only empty slots are filled here.  Triton is imported when a
kernel first runs.
"""
from __future__ import annotations

import importlib
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
    embedding_op,
    tree_sum_op,
    softmax_backward_op, log_softmax_backward_op, logsumexp_backward_op,
)


def _torch_impl(op) -> Callable:
    """The Python function ``op`` was defined from (what its CPU slot runs)."""
    fn = getattr(op, "_init_fn", None)
    if not callable(fn):
        raise TypeError(f"{op!r}: expected a torch.library custom op built from a Python function")
    return fn


def _triton(module: str, name: str) -> Callable:
    """The CUDA kernel ``tpinv.kernels.<module>.<name>``, imported on its first call (so a
    CPU-only process never imports Triton); same arguments as the op's CPU kernel."""

    resolved: list[Callable] = []

    def kernel(*args, **kwargs):
        if not resolved:
            resolved.append(getattr(importlib.import_module(f"tpinv.kernels.{module}"), name))
        return resolved[0](*args, **kwargs)

    kernel.__qualname__ = kernel.__name__ = f"{module}.{name}"
    kernel.triton_module, kernel.triton_name = f"tpinv.kernels.{module}", name
    return kernel


#: (op, Triton-backed CUDA kernel) pairs registered ahead of the torch code.
TRITON_CUDA_KERNELS = (
    (sum_exp_partial_op, _triton("triton_softmax", "sum_exp_partial_cuda")),
    (softmax_op, _triton("triton_softmax", "softmax_forward_cuda")),
    (log_softmax_op, _triton("triton_softmax", "log_softmax_forward_cuda")),
    (logsumexp_op, _triton("triton_softmax", "logsumexp_forward_cuda")),
    (rms_norm_op, _triton("triton_norm", "rms_norm_forward_cuda")),
    (rms_norm_backward_op, _triton("triton_norm", "rms_norm_backward_cuda")),
    (rms_norm_backward_heads_op, _triton("triton_norm", "rms_norm_backward_heads_cuda")),
    (silu_mul_op, _triton("triton_elementwise", "silu_mul_forward_cuda")),
    (silu_mul_backward_op, _triton("triton_elementwise", "silu_mul_backward_cuda")),
    (apply_rope_op, _triton("triton_elementwise", "apply_rope_forward_cuda")),
    (apply_rope_backward_op, _triton("triton_elementwise", "apply_rope_backward_cuda")),
    (attention_op, _triton("triton_attention", "attention_forward_cuda")),
    (embedding_backward_op, _triton("triton_embedding", "embedding_backward_cuda")),
    (attention_backward_op, _triton("triton_attention_bwd", "attention_backward_cuda")),
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
    return filled


register_torch_cuda_kernels()
