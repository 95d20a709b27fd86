"""The files of a training checkpoint directory: names, the ``latest`` pointer, checksums, pruning.

Invariant: ``latest`` names only a complete step directory -- one renamed into place with its
``train_state.json`` (which lists the sha256 of every other file) -- and is replaced atomically;
:func:`prune_steps` removes only complete step directories older than the one ``latest`` names.
The directory layout is described in ``docs/checkpoints.md``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Optional

from tpinv.io.atomic_dir import fsync_dir, fsync_file
from tpinv.io.run_dir import LATEST_FILE, STATE_FILE
from tpinv.io.safetensors_stream import CheckpointError

__all__ = ["CheckpointError", "FORMAT_NAME", "FORMAT_VERSION", "LATEST_FILE", "STATE_FILE", "check_compatible",
           "file_sha256", "latest_name", "prune_steps", "read_train_state", "resolve_checkpoint", "step_dir_name",
           "verify_files", "write_latest"]

FORMAT_NAME, FORMAT_VERSION = "tpinv-train-state", 2


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_latest(root: str, name: str) -> None:
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


def latest_name(root: str) -> Optional[str]:
    path = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip() or None


def prune_steps(root: str, keep_last: int) -> list[str]:
    """Remove the complete step directories older than ``latest`` beyond the newest ``keep_last``.

    Never the directory ``latest`` names, nor a newer one, nor a save in progress (``*.tmp-*``)."""
    latest = latest_name(root)
    if latest is None or keep_last < 1:
        return []
    newest = int(latest.removeprefix("step_"))
    steps = sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit()
                   and os.path.isfile(os.path.join(root, n, STATE_FILE)) and int(n[5:]) <= newest)
    removed = [step_dir_name(s) for s in steps[:-keep_last] if s != newest]
    for name in removed:
        shutil.rmtree(os.path.join(root, name))
    return removed


def check_compatible(state: dict, model_args: dict, leaves: int, where: str) -> None:
    """Refuse a checkpoint saved for other model args or another leaf count (before reading tensors)."""
    saved = state.get("model_args", {})
    diff = [f"{k} (checkpoint {saved.get(k)!r}, this run {model_args.get(k)!r})"
            for k in sorted(set(saved) | set(model_args)) if saved.get(k) != model_args.get(k)]
    if diff:
        raise CheckpointError(f"{where} was saved for a different model: {'; '.join(diff)}")
    if state.get("leaves") != leaves:
        raise CheckpointError(f"{where} was saved with leaves={state.get('leaves')}, this run uses leaves={leaves}; "
                              f"the leaf count fixes the reduction order and must match")


def resolve_checkpoint(path: str) -> str:
    """The step directory ``path`` names: itself, or the one its ``latest`` file names."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} not found")
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return os.path.abspath(path)
    name = latest_name(path)
    if name is None:
        raise CheckpointError(f"{path} is not a training checkpoint: expected {STATE_FILE} in it, or a "
                              f"'{LATEST_FILE}' file naming a step directory")
    step_dir = os.path.join(path, name)
    if not os.path.isfile(os.path.join(step_dir, STATE_FILE)):
        raise CheckpointError(f"{path}/{LATEST_FILE} names {name}, but {step_dir}/{STATE_FILE} is missing")
    return os.path.abspath(step_dir)


def read_train_state(step_dir: str) -> dict:
    """Parse ``train_state.json`` and check its format version and that every listed file exists."""
    path = os.path.join(step_dir, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: not a {FORMAT_NAME} file")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: {FORMAT_NAME} format version {state.get('format_version')!r}; this tpinv "
                              f"reads version {FORMAT_VERSION} only (sharded torch.distributed.checkpoint files; "
                              f"version 1 held full tensors in optimizer.safetensors and is not read)")
    files = state.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointError(f"{path}: no file checksums (expected 'files' naming .metadata and the shard files)")
    for name in files:
        if not os.path.isfile(os.path.join(step_dir, name)):
            raise CheckpointError(f"{os.path.join(step_dir, name)} is missing: the checkpoint is incomplete")
    return state


def verify_files(step_dir: str, state: dict, part: tuple = (0, 1)) -> None:
    """Check the sha256 of the files ``train_state.json`` lists (``part=(i, n)``: every n-th from i)."""
    i, n = part
    for name in sorted(state["files"])[i::n]:
        if file_sha256(os.path.join(step_dir, name)) != state["files"][name]:
            raise CheckpointError(f"{os.path.join(step_dir, name)}: sha256 mismatch with {STATE_FILE}; "
                                  f"the file is corrupt")
