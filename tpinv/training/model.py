"""The model a run trains: a named config, a HF model directory, or a tpinv checkpoint, at any TP size.

A named config is initialized from the run's seed (the full tensors drawn on the CPU and
sliced), so every TP size starts from the same full weights.  A HF directory (``config.json``
+ safetensors) or a tpinv checkpoint (``tpinv.json``) supplies the weights instead: each rank
reads exactly its shard, values unchanged apart from the one cast to ``--dtype``.
"""
from __future__ import annotations


from tpinv.core.dtypes import MODEL_DTYPES, dtype_from_name
from tpinv.io.loading import load_model, source_model_args
from tpinv.models import check_model_sizes

__all__ = ["build_model", "resolve_model_args"]


def resolve_model_args(model: str, dtype: str):
    """``(ModelArgs, kind)`` of the ``--model`` source at the ``--dtype`` name (see :func:`source_model_args`)."""
    return source_model_args(model, dtype_from_name(dtype, allowed=MODEL_DTYPES))


def build_model(config, tp_group, tp: int, tp_rank: int):
    """``(ModelArgs, Transformer)``: this rank's shard of the model ``config.model`` names.

    The sizes are checked against ``tp`` and the leaf count first (a clear error before
    anything is built); :func:`tpinv.io.loading.load_model` -- the loader the inference
    engine uses -- then builds the model and reads exactly this rank's slice of the weights.
    """
    args, _ = resolve_model_args(config.model, config.dtype)
    check_model_sizes(args, tp, config.leaves)  # TP dividing heads, sizes splitting into leaves
    if getattr(config, "sequence_parallel", False) and config.seq_len % tp:
        raise ValueError(f"--seq-len {config.seq_len} is not a multiple of --tp {tp}: --sequence-parallel splits "
                         f"each sequence over the TP ranks (e.g. --seq-len {config.seq_len + (-config.seq_len) % tp})")
    if config.seq_len > args.max_position_embeddings:
        raise ValueError(f"seq_len={config.seq_len} exceeds the model's max_position_embeddings="
                         f"{args.max_position_embeddings}")
    model, _ = load_model(config.model, tp_group=tp_group, dtype=args.dtype, row_strategy=config.row_strategy,
                          leaves=config.leaves, init_seed=config.seed,
                          sequence_parallel=getattr(config, "sequence_parallel", False),
                          hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
                          dropout_seed=config.seed)
    if model.tp_size != tp or model.tp_rank != tp_rank:
        raise ValueError(f"the TP group holds rank {model.tp_rank} of {model.tp_size}, expected {tp_rank} of {tp}")
    model.set_recompute(config.recompute_granularity, config.recompute_method, config.recompute_num_layers)
    return model.args, model.train()
