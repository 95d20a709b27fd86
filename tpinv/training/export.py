"""A training checkpoint's model weights as an ordinary model directory (offline, one process).

Invariant: the exported tensors are the bytes the run trained -- each ``model/NAME`` tensor is
read whole from the sharded checkpoint (DCP assembles the chunks every rank wrote) and written
unchanged as a tpinv checkpoint (:func:`tpinv.io.checkpoint.save_checkpoint`), or further as a
HF directory (:func:`tpinv.io.hf_convert.convert_tpinv_to_hf`).  Every file's sha256 is
checked first.  Full tensors are held here on purpose: this is the offline tool, not the save.
"""
from __future__ import annotations

import os
import tempfile
import shutil

import torch
import torch.distributed.checkpoint as dcp

from tpinv.io.checkpoint import save_checkpoint
from tpinv.io.hf_keys import args_from_dict
from tpinv.training.ckpt_files import CheckpointError, read_train_state, resolve_checkpoint, verify_files
from tpinv.training.dcp_shards import one_process

__all__ = ["export_model", "read_full_tensors"]


def read_full_tensors(step_dir: str, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """``{NAME: full tensor}`` of every ``PREFIX + NAME`` tensor of a checked step directory."""
    reader = dcp.FileSystemReader(step_dir)
    meta = reader.read_metadata().state_dict_metadata
    full = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()
            if k.startswith(prefix) and hasattr(m, "chunks")}
    if not full:
        raise CheckpointError(f"{step_dir}: no {prefix}* tensors in its .metadata")
    dcp.load(full, storage_reader=reader, **one_process(dcp.load))
    return {k[len(prefix):]: v for k, v in full.items()}


def export_model(path: str, out_dir: str, *, hf: bool = False, overwrite: bool = False) -> str:
    """Write the model weights of the checkpoint ``path`` (a step directory, or a ``--save`` root's
    ``latest``) to ``out_dir`` as a tpinv checkpoint, or with ``hf=True`` a HF model directory."""
    step_dir = resolve_checkpoint(path)
    state = read_train_state(step_dir)
    verify_files(step_dir, state)
    meta = state["param_meta"]
    weights = read_full_tensors(step_dir)
    if set(weights) != set(meta):
        raise CheckpointError(f"{step_dir}: the tensors {sorted(set(weights) ^ set(meta))} are in only one of "
                              f".metadata and train_state.json's param_meta")
    args = args_from_dict(state["model_args"])
    common = dict(model_args=args, param_meta=meta, leaves=state["leaves"], row_strategy=state["row_strategy"],
                  extra={"step": state["step"], "exported_from": step_dir})
    if not hf:
        return save_checkpoint(weights, out_dir, overwrite=overwrite, **common)
    from tpinv.io.hf_convert import convert_tpinv_to_hf
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        tpinv_dir = save_checkpoint(weights, os.path.join(scratch, "tpinv"), **common)
        return convert_tpinv_to_hf(tpinv_dir, out_dir, overwrite=overwrite)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
