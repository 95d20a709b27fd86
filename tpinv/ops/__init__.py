"""Public invariant ops (``tpinv::*`` custom ops and their Python wrappers).

Each ``ops/<family>.py`` defines its ops completely with :func:`tpinv.ops.registry.define_op`
(reference kernel, CUDA kernel, input check); :data:`tpinv.ops.registry.OPS` lists them."""
from tpinv.ops.activation import silu_mul
from tpinv.ops.attention import attention
from tpinv.ops.cross_entropy import cross_entropy_grad, cross_entropy_lse
from tpinv.ops.embedding import embedding, embedding_backward
from tpinv.ops.linear import matmul, matmul_partial, tree_sum
from tpinv.ops.norm import rms_norm
from tpinv.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from tpinv.ops.softmax import (
    log_softmax, log_softmax_from_parts, logsumexp, logsumexp_from_parts, softmax, softmax_from_parts,
    sum_exp_partial,
)

__all__ = [
    "apply_rope",
    "attention",
    "cross_entropy_grad",
    "cross_entropy_lse",
    "embedding",
    "embedding_backward",
    "log_softmax",
    "log_softmax_from_parts",
    "logsumexp",
    "logsumexp_from_parts",
    "matmul",
    "matmul_partial",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "silu_mul",
    "softmax",
    "softmax_from_parts",
    "sum_exp_partial",
    "tree_sum",
]
