"""megatron-core integration: tpinv layers inside megatron-core GPT models, trained by megatron.

A ``ModuleSpec`` built from tpinv's layers (:func:`get_gpt_layer_tpinv_spec`), an in-place swap
of a built model's linears, embedding, loss and dropouts (:func:`swap_to_tpinv`), a builder
(:func:`build_gpt_model`), the global sample ids its dropout masks are keyed by
(:func:`dropout_sample_ids`), and the invariant grad norm for megatron's optimizers
(:func:`use_invariant_grad_norm`).  megatron-core 0.12 through 0.16 (:data:`SUPPORTED_RANGE`).
megatron-core is imported lazily; importing tpinv never imports it.
"""
from tpinv.megatron.dropout import dropout_sample_ids
from tpinv.megatron.grad_norm import invariant_grad_norm, use_invariant_grad_norm
from tpinv.megatron.spec import SUPPORTED, build_gpt_model, get_gpt_layer_tpinv_spec, swap_to_tpinv
from tpinv.megatron.version import SUPPORTED_RANGE, megatron_version

__all__ = ["SUPPORTED", "SUPPORTED_RANGE", "build_gpt_model", "dropout_sample_ids", "get_gpt_layer_tpinv_spec",
           "invariant_grad_norm", "megatron_version", "swap_to_tpinv", "use_invariant_grad_norm"]
