"""megatron-core integration: tpinv layers inside megatron-core GPT models.

A ``ModuleSpec`` built from tpinv's layers (:func:`get_gpt_layer_tpinv_spec`), an in-place swap
of a built model's linears (:func:`swap_to_tpinv`) and a builder (:func:`build_gpt_model`).
megatron-core is imported lazily; importing tpinv never imports it.
"""
from tpinv.megatron.spec import SUPPORTED, build_gpt_model, get_gpt_layer_tpinv_spec, swap_to_tpinv

__all__ = ["SUPPORTED", "build_gpt_model", "get_gpt_layer_tpinv_spec", "swap_to_tpinv"]
