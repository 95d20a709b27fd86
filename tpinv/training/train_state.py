"""Training checkpoints: atomic, complete (weights, fp32 masters, AdamW moments, step, RNG, data
position), and loadable at any TP size.

Layout of ``ROOT`` (the ``--save`` directory)::

    latest                      the name of the newest complete step directory (replaced atomically)
    step_00000040/              one directory per save, renamed into place only when complete
        model/                  a tpinv checkpoint (tpinv.io.checkpoint) of the full model weights
        optimizer.safetensors   full fp32 tensors: master/NAME, exp_avg/NAME, exp_avg_sq/NAME, rng/torch
        train_state.json        step, data position, LR schedule, RNG, model args, sha256 of the file above

Every tensor is stored *full*: the TP shards are gathered exactly (byte concatenation in rank
order) before writing -- simple and fine at the sizes this runs at -- and at load each rank slices
its shard of any TP size out of the full tensor, so values travel bit for bit.  Only global
rank 0 writes; the outcome is broadcast, so every rank raises the same error.  A failed or
interrupted save leaves ``latest`` and the step directory it names untouched.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import tempfile
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from tpinv.io.atomic_dir import atomic_directory, fsync_dir, fsync_file, write_json
from tpinv.io.run_dir import clean_stale_temps
from tpinv.io.checkpoint import (load_shard, param_meta_from_module, param_replicas_from_module, save_checkpoint,
                                 shard_index)
from tpinv.distributed.groups import group_size
from tpinv.distributed.reduce import gather_shards
from tpinv.io.safetensors_stream import CheckpointError, SafetensorsReader, TensorSpec, write_safetensors

__all__ = ["CheckpointError", "save_train_state", "load_train_state", "resolve_checkpoint", "read_train_state",
           "step_dir_name", "STATE_FILE", "OPTIM_FILE", "MODEL_DIR", "LATEST_FILE"]

FORMAT_NAME, FORMAT_VERSION = "tpinv-train-state", 1
STATE_FILE, OPTIM_FILE, MODEL_DIR, LATEST_FILE = "train_state.json", "optimizer.safetensors", "model", "latest"
_MOMENTS = ("master", "exp_avg", "exp_avg_sq")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _full(t: torch.Tensor, dim: Optional[int], tp_group, replicas: int = 1) -> torch.Tensor:
    if dim is None or group_size(tp_group) == 1:
        return t.detach().clone()
    return gather_shards(t, tp_group, dim, replicas)


def _rng_state() -> tuple[dict, torch.Tensor]:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return ({"python": [version, list(mt), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached]},
            torch.get_rng_state())


def _set_rng_state(rng: dict, torch_state: torch.Tensor) -> None:
    version, mt, gauss = rng["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch_state)


def _write_latest(root: str, name: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=LATEST_FILE + ".tmp-", dir=root)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            fsync_file(f)
        os.replace(tmp, os.path.join(root, LATEST_FILE))
        fsync_dir(root)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _latest_name(root: str) -> Optional[str]:
    path = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip() or None


def _write(root: str, step: int, model_args, meta: dict, full: dict, state: dict,
           torch_rng: torch.Tensor) -> str:
    out = os.path.join(root, step_dir_name(step))
    with atomic_directory(out, overwrite=True) as tmp:
        weights = {name: full[name]["weight"] for name in meta}
        save_checkpoint(weights, os.path.join(tmp, MODEL_DIR), model_args=model_args, param_meta=meta,
                        leaves=state["leaves"], row_strategy=state["row_strategy"], extra={"step": step})
        pairs = [(TensorSpec(f"{k}/{name}", torch.float32, tuple(t[k].shape)), lambda x=t[k]: x)
                 for name, t in full.items() for k in _MOMENTS]
        pairs.append((TensorSpec("rng/torch", torch.uint8, tuple(torch_rng.shape)), lambda: torch_rng))
        write_safetensors(os.path.join(tmp, OPTIM_FILE), pairs, metadata={"format": "pt"})
        state = dict(state, files={OPTIM_FILE: _file_sha256(os.path.join(tmp, OPTIM_FILE))})
        write_json(os.path.join(tmp, STATE_FILE), state)
    _write_latest(root, step_dir_name(step))
    return out


def save_train_state(root: str, *, step: int, model, optimizer, layout, model_args, state: dict,
                     tp_group=None, is_writer: bool = True, world_group=None) -> str:
    """Save the training state after ``step`` steps into ``root/step_XXXXXXXX`` (collective on all ranks).

    ``state`` holds the JSON-able run state (data position, schedule, config, ``leaves``,
    ``row_strategy``); model args, optimizer state and RNG are added here.  Raises
    :class:`CheckpointError` on every rank if the writer fails (e.g. disk full); the previous
    checkpoint stays complete and ``latest`` keeps naming it.  ``world_group`` holds every rank
    that saves (the writer's error is broadcast over it); ``None`` only in a single-process run.
    """
    meta = param_meta_from_module(model)
    full = {}
    for s in layout.slots:
        local = dict(optimizer.tensors(s.name), weight=layout.params[s.name])
        full[s.name] = {k: _full(v, s.partition_dim, tp_group, s.replicas) for k, v in local.items()}
    rng, torch_rng = _rng_state()
    state = dict(state, format=FORMAT_NAME, format_version=FORMAT_VERSION, step=step, rng=rng,
                 optimizer=optimizer.state(), model_args=_args_dict(model_args))
    error, path = None, os.path.join(os.path.abspath(root), step_dir_name(step))
    if is_writer:
        try:
            os.makedirs(root, exist_ok=True)
            clean_stale_temps(root)  # what a killed save left (the caller holds the directory's lock)
            path = _write(os.path.abspath(root), step, model_args, meta, full, state, torch_rng)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            previous = _latest_name(root) if os.path.isdir(root) else None
            keep = f"; the previous checkpoint {os.path.join(root, previous)} is intact" if previous else \
                "; no checkpoint was written"
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                error = f"disk full while saving the checkpoint of step {step} to {root} ({e}){keep}"
            else:
                error = f"saving the checkpoint of step {step} to {root} failed: {type(e).__name__}: {e}{keep}"
    if group_size(world_group, "world_group") > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0, group=world_group)
        error = box[0]
    if error:
        raise CheckpointError(error)
    return path


def _args_dict(model_args) -> dict:
    from tpinv.io.hf_keys import args_to_dict
    return args_to_dict(model_args)


def resolve_checkpoint(path: str) -> str:
    """The step directory ``path`` names: itself, or the one its ``latest`` file names."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} not found")
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return os.path.abspath(path)
    name = _latest_name(path)
    if name is None:
        raise CheckpointError(f"{path} is not a training checkpoint: expected {STATE_FILE} in it, or a "
                              f"'{LATEST_FILE}' file naming a step directory")
    step_dir = os.path.join(path, name)
    if not os.path.isfile(os.path.join(step_dir, STATE_FILE)):
        raise CheckpointError(f"{path}/{LATEST_FILE} names {name}, but {step_dir}/{STATE_FILE} is missing")
    return os.path.abspath(step_dir)


def read_train_state(step_dir: str) -> dict:
    """Parse and check ``train_state.json`` and the sha256 of the optimizer file."""
    path = os.path.join(step_dir, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_NAME or \
            state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: not a {FORMAT_NAME} version {FORMAT_VERSION} file")
    optim = os.path.join(step_dir, OPTIM_FILE)
    if not os.path.isfile(optim):
        raise CheckpointError(f"{optim} is missing: the checkpoint is incomplete")
    want = state.get("files", {}).get(OPTIM_FILE)
    if want != _file_sha256(optim):
        raise CheckpointError(f"{optim}: sha256 mismatch with {STATE_FILE}; the file is corrupt")
    return state


def _check_compatible(state: dict, model_args: dict, leaves: int, where: str) -> None:
    saved = state.get("model_args", {})
    diff = [f"{k} (checkpoint {saved.get(k)!r}, this run {model_args.get(k)!r})"
            for k in sorted(set(saved) | set(model_args)) if saved.get(k) != model_args.get(k)]
    if diff:
        raise CheckpointError(f"{where} was saved for a different model: {'; '.join(diff)}")
    if state.get("leaves") != leaves:
        raise CheckpointError(f"{where} was saved with leaves={state.get('leaves')}, this run uses leaves={leaves}; "
                              f"the leaf count fixes the reduction order and must match")


def load_train_state(path: str, *, model, optimizer, layout, model_args, leaves: int, tp_size: int = 1,
                     tp_rank: int = 0) -> dict:
    """Load a checkpoint (a ``--save`` root or a step directory) into this rank's shards; returns its state.

    The model weights, master weights and moments are sliced for ``tp_rank`` of ``tp_size``;
    the RNG states are restored.  Raises :class:`CheckpointError` for a missing, incomplete or
    corrupt checkpoint or one saved for a different model.
    """
    step_dir = resolve_checkpoint(path)
    state = read_train_state(step_dir)
    _check_compatible(state, _args_dict(model_args), leaves, step_dir)
    meta = param_meta_from_module(model)
    try:
        weights = load_shard(os.path.join(step_dir, MODEL_DIR), tp_size, tp_rank, param_meta=meta, verify=True,
                             replicas=param_replicas_from_module(model))
    except (KeyError, ValueError, OSError) as e:
        raise CheckpointError(f"{step_dir}/{MODEL_DIR}: {e}") from None
    with SafetensorsReader(os.path.join(step_dir, OPTIM_FILE)) as reader, torch.no_grad():
        for s in layout.slots:
            index = shard_index(s.full_shape, s.partition_dim, tp_size, tp_rank, s.name, s.replicas)
            layout.params[s.name].copy_(_checked(weights[s.name], s.shape, f"model {s.name}"))
            local = optimizer.tensors(s.name)
            for k in _MOMENTS:
                key = f"{k}/{s.name}"
                if key not in reader.specs or tuple(reader.specs[key].shape) != tuple(s.full_shape):
                    raise CheckpointError(f"{step_dir}/{OPTIM_FILE}: {key} is missing or not of shape "
                                          f"{list(s.full_shape)}")
                local[k].copy_(_checked(reader.get(key, index), s.shape, key))
        torch_rng = reader.get("rng/torch") if "rng/torch" in reader.specs else torch.get_rng_state()
    optimizer.load_state(state["optimizer"])
    _set_rng_state(state["rng"], torch_rng)
    state["path"] = step_dir
    return state


def _checked(t: torch.Tensor, shape: tuple, what: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{what}: checkpoint slice has shape {list(t.shape)}, expected {list(shape)}")
    return t
