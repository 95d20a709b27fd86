"""Reading and writing models: the tpinv checkpoint format (:mod:`~tpinv.io.checkpoint`),
streamed safetensors, atomic directories, Hugging Face and megatron key maps and converters,
tokenizers, and :func:`~tpinv.io.loading.load_model` (a model from any of those sources)."""
