"""Qwen3, Llama and Mistral decoders built from tpinv layers: the same bits at any TP size,
any batch size, in a full forward and in KV-cache decoding.

One shared decoder (:class:`Transformer`); the families differ only by :class:`ModelArgs`
flags.  Installed as ``tpinv.models``.
"""
from tpinv.models.args import ARCHITECTURES, FAMILIES, ModelArgs, check_model_sizes
from tpinv.models.configs import CONFIGS, get_config
from tpinv.models.kv_cache import KVCache
from tpinv.models.transformer import Transformer

__all__ = ["ARCHITECTURES", "CONFIGS", "FAMILIES", "KVCache", "ModelArgs", "Transformer",
           "check_model_sizes", "get_config"]
