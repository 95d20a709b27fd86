"""Build a :class:`Transformer` for one TP rank from a named config, a tpinv checkpoint or a HF directory.

Whatever the source and the TP size, a rank ends up with its slices of the same full
weights: named configs are initialised from the full master weights with a seeded RNG,
checkpoints are resharded tensor by tensor at load (nothing is held twice in memory).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from tpinv.checkpoint import CheckpointError, load_shard, param_meta_from_module, read_info, shard_index
from tpinv.contract import DEFAULT_LEAVES
from tpinv.layers.common import group_size_rank
from tpinv.models.configs import ALIASES, CONFIGS, get_config
from tpinv.models.hf_keys import args_from_dict
from tpinv.models.transformer import Transformer


def _empty_model(args, tp_group, leaves, row_strategy) -> Transformer:
    # Random init is wasted work here but keeps one construction path; weights are overwritten.
    return Transformer(args, tp_group=tp_group, leaves=leaves, row_strategy=row_strategy)


def _load_state(model: Transformer, state: dict, source: str) -> Transformer:
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{source}: missing tensors {sorted(missing)}, unexpected {sorted(unexpected)}")
    return model


def _from_hf_dir(path: str, tp_group, leaves, row_strategy, dtype) -> Transformer:
    from tpinv.models.hf_convert import HFWeights, plan_import, read_hf_config
    from tpinv.models.transformer import check_model_sizes

    _, args = read_hf_config(path)
    tp, rank = group_size_rank(tp_group)
    check_model_sizes(args, tp, leaves)
    sources = plan_import(HFWeights(path), args, dtype, row_strategy)
    args = args.replace(dtype=sources[0].dtype)
    model = _empty_model(args, tp_group, leaves, row_strategy)
    meta = param_meta_from_module(model)
    state = {}
    for src in sources:
        index = shard_index(src.shape, meta.get(src.name), tp, rank, src.name)
        state[src.name] = src.read(index).to(src.dtype).contiguous()
    return _load_state(model, state, path)


def build_model(source: str, *, tp_group=None, leaves: int = DEFAULT_LEAVES, row_strategy: str = "tree",
                dtype: Optional[torch.dtype] = None, seed: int = 0) -> Transformer:
    """This rank's model from ``source``: a config name (``get_config``), a tpinv checkpoint
    directory (``tpinv.json``) or a HF model directory (``config.json`` + safetensors).

    ``dtype`` casts the weights (``None`` keeps the checkpoint's, or the config's default);
    ``seed`` seeds the initialisation of a named config.
    """
    if source in CONFIGS or source in ALIASES:
        args = get_config(source, **({"dtype": dtype} if dtype is not None else {}))
        torch.manual_seed(seed)
        return Transformer(args, tp_group=tp_group, leaves=leaves, row_strategy=row_strategy)
    if os.path.isfile(os.path.join(source, "tpinv.json")):
        info = read_info(source)
        args = args_from_dict(info.model_args)
        if dtype is not None:
            args = args.replace(dtype=dtype)
        tp, rank = group_size_rank(tp_group)
        model = _empty_model(args, tp_group, leaves, row_strategy)
        state = load_shard(source, tp, rank, row_strategy, param_meta_from_module(model), dtype=args.dtype)
        return _load_state(model, state, source)
    if os.path.isfile(os.path.join(source, "config.json")):
        return _from_hf_dir(source, tp_group, leaves, row_strategy, dtype)
    names = ", ".join(sorted(CONFIGS))
    raise FileNotFoundError(f"model {source!r} is neither a named config ({names}) nor a directory with "
                            f"tpinv.json (tpinv checkpoint) or config.json (HF model)")
