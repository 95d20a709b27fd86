"""Training checkpoints: sharded (every rank writes only its own shards, through
torch.distributed.checkpoint), complete, checksummed, atomic, and loadable at any TP x DP layout.

Layout of ``ROOT`` (the ``--save`` directory; the file names: :mod:`tpinv.training.ckpt_files`)::

    latest                  the name of the newest complete step directory (replaced atomically)
    step_00000040/          one directory per save, renamed into place only when complete
        .metadata           DCP's index: every tensor's global shape, dtype and chunks
        __R_0.distcp        the chunks rank R wrote (DCP's files)
        train_state.json    step, data position, optimizer and LR-schedule state, per-rank RNG,
                            model args, config, and the sha256 of every file above

The tensors are ``model/NAME`` (the weights in the model dtype) and ``master/NAME``,
``exp_avg/NAME``, ``exp_avg_sq/NAME`` (fp32), each described as its full TP=1 tensor
(:mod:`tpinv.training.dcp_shards`); replicated chunks (DP replicas, replicated KV heads) are
written once.  Loading reads, for each rank of any layout, exactly the chunk it holds -- the
same bytes -- so a run resumed at another TP x DP layout continues bit for bit.

A save: rank 0 makes ``step_X.tmp-*``; every rank writes its chunks there; the files are hashed
(round-robin over the ranks) and rank 0 writes ``train_state.json``, renames the directory into
place, replaces ``latest``, and removes the older complete steps beyond ``keep_last``.  With
``async_save`` the shards are first copied to host memory and written by a background thread
while training goes on; the save is *finalized* (hashed, published) at the next save or at the
end of the run, so ``latest`` moves only then.  Any failure raises :class:`CheckpointError` on
every rank and leaves ``latest`` and the step it names untouched.  Format version 1 (full
tensors in ``optimizer.safetensors``) is refused with an error naming it.
"""
from __future__ import annotations

import errno
import inspect
import os
import random
import shutil
import tempfile
import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from tpinv.io.atomic_dir import publish_directory, write_json
from tpinv.io.run_dir import clean_stale_temps
from tpinv.training.ckpt_files import (FORMAT_NAME, FORMAT_VERSION, STATE_FILE, CheckpointError, file_sha256,
                                       latest_name, prune_steps, read_train_state, resolve_checkpoint, step_dir_name,
                                       verify_files, write_latest)
from tpinv.training.dcp_shards import ShardMeshes, one_process, sharded_state_dict

__all__ = ["Checkpointer", "write_shards"]

# DCP's note that it runs in one process: ``no_dist=True`` (a run without torch.distributed) says so
warnings.filterwarnings("ignore", message="torch.distributed is disabled", module=r"torch\.distributed\.checkpoint")


def _rng_state() -> dict:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(mt), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached],
            "torch": bytes(torch.get_rng_state().tolist()).hex()}


def _set_rng_state(rng: dict) -> None:
    version, mt, gauss = rng["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(list(bytes.fromhex(rng["torch"])), dtype=torch.uint8))


def _agree(error: Optional[str], group) -> Optional[str]:
    """The first error any rank of ``group`` reports (the same on every rank), or None."""
    if group is None:
        return error
    box: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(box, error, group=group)
    return next((e for e in box if e), None)


class _Pending:
    """An asynchronous save whose shards are being written."""

    def __init__(self, future, tmp: str, step: int, state: dict):
        self.future, self.tmp, self.step, self.state = future, tmp, step, state


class Checkpointer:
    """Saves and loads one run's training state (every method is collective over the world).

    ``meshes`` is None for a single process without torch.distributed; otherwise the DCP
    collectives run on a gloo group of the whole world made for checkpoints (a background
    save never shares a group with the training collectives).
    """

    def __init__(self, root: Optional[str], *, tp: int = 1, dp: int = 1, rank: int = 0, distributed: bool = False,
                 async_save: bool = False, keep_last: Optional[int] = None):
        self.root = os.path.abspath(root) if root else None
        self.rank, self.async_save, self.keep_last = rank, async_save, keep_last
        self.meshes = ShardMeshes(tp, dp) if distributed else None
        self._group, self.pending = None, None

    @property
    def group(self):
        if self.meshes is not None and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _dcp_kwargs(self, dcp_call) -> dict:
        return {"process_group": self.group} if self.meshes is not None else one_process(dcp_call)

    def _bcast(self, obj):
        if self.meshes is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    # -- save ------------------------------------------------------------------------------------
    def save(self, *, step: int, layout, optimizer, state: dict) -> str:
        """Save the state after ``step`` steps; returns ``ROOT/step_XXXXXXXX`` (not yet there if async)."""
        self.finalize()
        rng = _rng_state()
        rngs = [rng] if self.meshes is None else [None] * dist.get_world_size(self.group)
        if self.meshes is not None:
            dist.all_gather_object(rngs, rng, group=self.group)
        state = dict(state, format=FORMAT_NAME, format_version=FORMAT_VERSION, step=step, rng=rngs,
                     optimizer=optimizer.state())
        tmp, error = None, None
        if self.rank == 0:
            try:
                os.makedirs(self.root, exist_ok=True)
                clean_stale_temps(self.root)  # what a killed save left (the caller holds the directory's lock)
                tmp = tempfile.mkdtemp(prefix=step_dir_name(step) + ".tmp-", dir=self.root)
            except OSError as e:
                error = self._failed(step, e)
        tmp, error = self._bcast((tmp, error))
        if error:
            raise CheckpointError(error)
        try:
            shards = sharded_state_dict(layout, optimizer, self.meshes, stage=self.async_save)
            writer = dcp.FileSystemWriter(tmp, thread_count=1)
            if self.async_save:
                future = write_shards(shards, writer, self._dcp_kwargs(dcp.async_save), asynchronous=True)
                self.pending = _Pending(future, tmp, step, state)
                return os.path.join(self.root, step_dir_name(step))
            write_shards(shards, writer, self._dcp_kwargs(dcp.save))
        except Exception as e:  # noqa: BLE001 - reported on every rank by _publish
            error = self._failed(step, e)
        except BaseException:  # interrupted: what was written goes, latest stays
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self._publish(tmp, step, state, error)

    def finalize(self) -> Optional[str]:
        """Wait for the asynchronous save in flight (if any) and publish it; its step directory or None."""
        if self.pending is None:
            return None
        pending, self.pending, error = self.pending, None, None
        try:
            pending.future.result()
        except Exception as e:  # noqa: BLE001
            error = self._failed(pending.step, e)
        return self._publish(pending.tmp, pending.step, pending.state, error)

    def _failed(self, step: int, e: BaseException) -> str:
        previous = latest_name(self.root) if os.path.isdir(self.root) else None
        keep = f"; the previous checkpoint {os.path.join(self.root, previous)} is intact" if previous else \
            "; no checkpoint was written"
        cause = getattr(e, "failures", None) or e  # DCP's CheckpointException carries each rank's error
        text = f"{type(e).__name__}: {e}"
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left" in str(cause):
            return f"disk full while saving the checkpoint of step {step} to {self.root} ({e}){keep}"
        return f"saving the checkpoint of step {step} to {self.root} failed: {text}{keep}"

    def _publish(self, tmp: str, step: int, state: dict, error: Optional[str]) -> str:
        """Hash the written files, write the state, rename into place, replace ``latest`` (collective)."""
        error = _agree(error, self.group)
        hashes: dict = {}
        if not error:
            world = 1 if self.meshes is None else dist.get_world_size(self.group)
            rank = 0 if self.meshes is None else dist.get_rank(self.group)
            try:
                names = sorted(n for n in os.listdir(tmp) if n != STATE_FILE)
                hashes = {n: file_sha256(os.path.join(tmp, n)) for n in names[rank::world]}
            except OSError as e:
                error = self._failed(step, e)
            if self.meshes is not None:
                parts: list = [None] * world
                dist.all_gather_object(parts, (hashes, error), group=self.group)
                hashes = {k: v for h, _ in parts for k, v in h.items()}
                error = next((e for _, e in parts if e), None)
        out = os.path.join(self.root, step_dir_name(step))
        if self.rank == 0:
            try:
                if error:
                    raise RuntimeError(error)
                write_json(os.path.join(tmp, STATE_FILE), dict(state, files=hashes))
                publish_directory(tmp, out)
                write_latest(self.root, step_dir_name(step))
                if self.keep_last:
                    prune_steps(self.root, self.keep_last)
            except Exception as e:  # noqa: BLE001
                shutil.rmtree(tmp, ignore_errors=True)
                error = error or self._failed(step, e)
        error = self._bcast(error)
        if error:
            raise CheckpointError(error)
        return out

    # -- load ------------------------------------------------------------------------------------
    def load(self, path: str, *, layout, optimizer, check=None) -> dict:
        """Load a checkpoint (a ``--save`` root or a step directory) into this rank's shards.

        ``check(state, step_dir)`` may refuse the checkpoint (e.g. another model) before any
        tensor is read.  Restores the optimizer state and this rank's RNG (rank 0's when the
        world size changed); returns the saved state with ``path`` set to the step directory.
        """
        step_dir = resolve_checkpoint(path)
        state = read_train_state(step_dir)
        if check is not None:
            check(state, step_dir)
        world = 1 if self.meshes is None else dist.get_world_size(self.group)
        rank = 0 if self.meshes is None else dist.get_rank(self.group)
        error = None
        try:
            verify_files(step_dir, state, part=(rank, world))
        except CheckpointError as e:
            error = str(e)
        error = _agree(error, self.group)
        if error:
            raise CheckpointError(error)
        shards = sharded_state_dict(layout, optimizer, self.meshes)
        try:
            with torch.no_grad():
                dcp.load(shards, storage_reader=dcp.FileSystemReader(step_dir), **self._dcp_kwargs(dcp.load))
        except Exception as e:  # noqa: BLE001 - DCP raises on every rank alike
            raise CheckpointError(f"{step_dir}: reading the sharded tensors failed: "
                                  f"{' '.join(str(e).split())[:600]}") from None
        optimizer.load_state(state["optimizer"])
        rngs = state["rng"]
        _set_rng_state(rngs[rank] if len(rngs) == world else rngs[0])
        state["path"] = step_dir
        return state


class _AlreadyStaged(AsyncStager):
    """The shards were copied to host memory when the state dict was built (``stage=True``): DCP's
    default stager would copy them a second time."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def write_shards(shards: dict, writer, kwargs: dict, asynchronous: bool = False):
    """The DCP write of this rank's shards (a future when ``asynchronous``)."""
    if asynchronous:
        if "async_stager" in inspect.signature(dcp.async_save).parameters:  # else DCP stages the copies again
            kwargs = dict(kwargs, async_stager=_AlreadyStaged())
        return dcp.async_save(shards, storage_writer=writer, **kwargs)
    return dcp.save(shards, storage_writer=writer, **kwargs)


