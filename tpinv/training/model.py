"""The model a run trains: a named config, a HF model directory, or a tpinv checkpoint, at any TP size.

A named config is initialized from the run's seed (the full tensors drawn on the CPU and
sliced), so every TP size starts from the same full weights.  A HF directory (``config.json``
+ safetensors) or a tpinv checkpoint (``tpinv.json``) supplies the weights instead: each rank
reads exactly its shard, values unchanged apart from the one cast to ``--dtype``.
"""
from __future__ import annotations

import os

import torch

from tpinv.io.checkpoint import read_info
from tpinv.models import check_model_sizes, get_config

__all__ = ["DTYPES", "build_model", "resolve_model_args"]

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_model_args(model: str, dtype: str):
    """``(ModelArgs, kind)`` with ``kind`` one of ``"config"``, ``"hf"``, ``"tpinv"``."""
    dt = _dtype(dtype)
    if os.path.isdir(model):
        if os.path.isfile(os.path.join(model, "tpinv.json")):
            from tpinv.io.hf_keys import args_from_dict
            return args_from_dict(read_info(model).model_args).replace(dtype=dt), "tpinv"
        if os.path.isfile(os.path.join(model, "config.json")):
            from tpinv.io.hf_convert import read_hf_config
            return read_hf_config(model)[1].replace(dtype=dt), "hf"
        raise FileNotFoundError(f"model directory {model} has neither config.json (HF) nor tpinv.json (tpinv)")
    try:
        return get_config(model, dtype=dt), "config"
    except KeyError as e:
        raise ValueError(f"{e.args[0]}; or pass a HF model directory or a tpinv checkpoint") from None


def build_model(config, tp_group, tp: int, tp_rank: int):
    """``(ModelArgs, Transformer)``: this rank's shard of the model ``config.model`` names.

    The sizes are checked against ``tp`` and the leaf count first (a clear error before
    anything is built); :func:`tpinv.io.loading.load_model` -- the loader the inference
    engine uses -- then builds the model and reads exactly this rank's slice of the weights.
    """
    from tpinv.io.loading import load_model
    args, _ = resolve_model_args(config.model, config.dtype)
    check_model_sizes(args, tp, config.leaves)  # TP dividing heads, sizes splitting into leaves
    if config.seq_len > args.max_position_embeddings:
        raise ValueError(f"seq_len={config.seq_len} exceeds the model's max_position_embeddings="
                         f"{args.max_position_embeddings}")
    model, _ = load_model(config.model, tp_group=tp_group, dtype=args.dtype, row_strategy=config.row_strategy,
                          leaves=config.leaves, init_seed=config.seed,
                          sequence_parallel=getattr(config, "sequence_parallel", False))
    if model.tp_size != tp or model.tp_rank != tp_rank:
        raise ValueError(f"the TP group holds rank {model.tp_rank} of {model.tp_size}, expected {tp_rank} of {tp}")
    return model.args, model.train()
