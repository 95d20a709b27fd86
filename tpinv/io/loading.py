"""Load this rank's :class:`~tpinv.models.Transformer` from a named config, a tpinv checkpoint or a HF directory.

Loading only moves bytes: every source gives rank ``r`` of a TP group of size ``C`` exactly
the slice ``r`` of the full tensors (random init included: the full tensors are drawn on
CPU from ``init_seed`` and sliced), so the model holds the same weights at every TP size.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from tpinv.distributed.groups import group_size_rank
from tpinv.io.checkpoint import (META_FILE, load_shard, param_meta_from_module, param_replicas_from_module, read_info,
                                 shard_index)
from tpinv.core.contract import DEFAULT_LEAVES
from tpinv.models.args import check_model_sizes
from tpinv.models.configs import config_names, get_config
from tpinv.io.hf_keys import args_from_dict
from tpinv.io.run_dir import is_training_checkpoint
from tpinv.models.transformer import Transformer
from tpinv.io.tokenizer import load_tokenizer

__all__ = ["check_source", "load_model", "source_kind", "source_model_args"]


def source_kind(source: str) -> str:
    """``"config"`` (a named config), ``"tpinv"`` (a checkpoint directory) or ``"hf"`` (a HF directory)."""
    if os.path.isdir(source):
        if is_training_checkpoint(source):
            raise ValueError(f"{source} is a training checkpoint (sharded), not a model directory: export its weights "
                             f"with tools/export_checkpoint.py {source} OUT_DIR and use OUT_DIR (or resume the run "
                             f"with launch/pretrain.py --load {source})")
        if os.path.isfile(os.path.join(source, META_FILE)):
            return "tpinv"
        if os.path.isfile(os.path.join(source, "config.json")):
            return "hf"
        raise FileNotFoundError(f"{source} holds neither {META_FILE} (tpinv checkpoint) nor config.json (HF model)")
    try:
        get_config(source)
    except KeyError:
        if os.path.exists(source):
            raise ValueError(f"model source {source} is a file; expected a named config, a tpinv checkpoint "
                             f"directory or a HF model directory") from None
        if os.sep in source or source.startswith("."):
            raise FileNotFoundError(f"model source {source}: no such directory") from None
        raise ValueError(f"model source {source!r} is neither a directory nor a named config; named configs: "
                         f"{', '.join(config_names())}") from None
    return "config"


def source_model_args(source: str, dtype: Optional[torch.dtype] = None):
    """``(ModelArgs, kind)`` of ``source`` (kind from :func:`source_kind`), with ``dtype`` applied if given.

    The one place that decides what a model source is: the loader, the trainer and the tools call it.
    """
    kind = source_kind(source)
    if kind == "config":
        args = get_config(source)
    elif kind == "tpinv":
        args = args_from_dict(read_info(source).model_args)
    else:
        from tpinv.io.hf_convert import read_hf_config
        args = read_hf_config(source)[1]
    return (args.replace(dtype=dtype) if dtype is not None else args), kind


def check_source(source: str, tp_sizes=(1,), leaves: Optional[int] = None):
    """``source``'s ModelArgs once it is known to load at every TP size of ``tp_sizes``: what
    :func:`load_model` would refuse (no such source, a training checkpoint, a size that a TP size
    or the leaves do not divide), refused before any rank or weight, as ValueError/OSError.
    ``leaves`` defaults as in :func:`load_model`."""
    args, kind = source_model_args(source)
    leaves = leaves or (read_info(source).leaves if kind == "tpinv" else DEFAULT_LEAVES)
    for tp in tp_sizes:
        check_model_sizes(args, tp, leaves)
    return args


def _tokenizer_in(directory: str):
    try:
        return load_tokenizer(directory)
    except FileNotFoundError:  # a directory without a tokenizer file
        return None


def load_model(source: str, *, tp_group=None, dtype: Optional[torch.dtype] = None, row_strategy: str = "tree",
               leaves: Optional[int] = None, init_seed: int = 0, sequence_parallel: bool = False,
               hidden_dropout: float = 0.0, attention_dropout: float = 0.0, dropout_seed: int = 0):
    """``(model, tokenizer or None)`` for ``source`` at the TP size of ``tp_group`` (eval mode).

    ``leaves`` defaults to the checkpoint's (tpinv) or :data:`~tpinv.core.contract.DEFAULT_LEAVES`;
    ``sequence_parallel`` builds the model with Megatron's sequence parallelism and
    ``hidden_dropout`` / ``attention_dropout`` / ``dropout_seed`` with dropout (both for training).
    """
    sp = {"sequence_parallel": sequence_parallel, "hidden_dropout": hidden_dropout,
          "attention_dropout": attention_dropout, "dropout_seed": dropout_seed}
    tp, rank = group_size_rank(tp_group)
    args, kind = source_model_args(source, dtype)
    if kind == "config":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            model = Transformer(args, tp_group=tp_group, leaves=leaves or DEFAULT_LEAVES, row_strategy=row_strategy,
                                **sp)
        return model.eval(), None
    if kind == "tpinv":
        model = Transformer(args, tp_group=tp_group, leaves=leaves or read_info(source).leaves, row_strategy=row_strategy,
                            **sp)
        state = load_shard(source, tp, rank, row_strategy, param_meta_from_module(model), dtype=args.dtype,
                           replicas=param_replicas_from_module(model), verify=True)
        model.load_state_dict(state, strict=True)
        return model.eval(), _tokenizer_in(source)
    from tpinv.io.hf_convert import HFWeights, plan_import
    model = Transformer(args, tp_group=tp_group, leaves=leaves or DEFAULT_LEAVES, row_strategy=row_strategy, **sp)
    sources = plan_import(HFWeights(source), args, args.dtype, row_strategy)
    reps = param_replicas_from_module(model)
    state = {s.name: s.read(shard_index(s.shape, s.partition_dim, tp, rank, s.name, reps.get(s.name, 1))).to(s.dtype)
             for s in sources}
    model.load_state_dict(state, strict=True)
    return model.eval(), _tokenizer_in(source)
