"""This rank's training tensors as DTensors, so torch.distributed.checkpoint writes each chunk once
and reads any chunk at another TP x DP layout.

Invariant: the DTensor built here describes exactly the rank's local tensor -- same storage, no
copy, no gather -- placed in the *full* (TP=1) parameter at the offset the layout gives it:

* the world is laid out as in :mod:`tpinv.distributed.parallel` (TP innermost: global rank
  ``d * tp + t``), so the mesh is ``(dp, tp)``; a TP-sharded parameter is
  ``[Replicate(), Shard(partition_dim)]`` (chunk ``t`` of ``tp`` along its partition dim, the
  rank order :func:`tpinv.distributed.reduce.gather_shards` concatenates in);
* a replicated KV-head parameter (``replicas`` R, :mod:`tpinv.layers.kv_replication`: ranks
  ``[R*j, R*(j+1))`` hold piece ``j``) uses the view ``(dp, tp / R, R)`` of the same ranks with
  ``[Replicate(), Shard(dim), Replicate()]``;
* a parameter every TP rank holds whole is ``[Replicate(), Replicate()]``.

DCP's default save planner keeps one write item per distinct chunk (its replicated-chunk
dedup), so DP replicas and KV-head replicas are written once, and each rank writes only
pieces of tensors it already holds: a save allocates at most one shard at a time.  The
meshes are built without process groups (``_init_backend=False``, torch >= 2.6): DCP only needs
each rank's coordinate (from its global rank) to compute the chunk offsets; its own collectives
run on the group it is given.
Why DTensor rather than DCP's planner API: the chunk offsets then come from one public
description (mesh + placements) that DCP's load planner also uses to reshard.
"""
from __future__ import annotations

import inspect

from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["MOMENTS", "ShardMeshes", "one_process", "sharded_state_dict", "full_state_dict"]


def one_process(dcp_call) -> dict:
    """The keywords telling ``dcp_call`` (``dcp.save``, ``dcp.async_save``, ``dcp.load``) that it runs in
    one process without torch.distributed: ``no_dist=True`` where the call has that keyword (``save`` and
    ``load`` from torch 2.7, ``async_save`` later); without it DCP runs so by itself when no process
    group exists (torch 2.6, and ``async_save`` at torch 2.7)."""
    return {"no_dist": True} if "no_dist" in inspect.signature(dcp_call).parameters else {}


#: The optimizer tensors saved per parameter, beside the model weight (key ``model/NAME``).
MOMENTS = ("master", "exp_avg", "exp_avg_sq")


class ShardMeshes:
    """The device meshes of one (tp, dp) layout, built once per device type and KV-replica count."""

    def __init__(self, tp: int, dp: int):
        self.tp, self.dp = tp, dp
        self._meshes: dict[tuple[str, int], DeviceMesh] = {}

    def mesh(self, device_type: str, replicas: int = 1) -> DeviceMesh:
        key = (device_type, replicas)
        if key not in self._meshes:
            ranks = torch.arange(self.tp * self.dp)
            shape = (self.dp, self.tp) if replicas == 1 else (self.dp, self.tp // replicas, replicas)
            self._meshes[key] = DeviceMesh(device_type, ranks.view(shape), _init_backend=False)
        return self._meshes[key]

    def dtensor(self, local: torch.Tensor, full_shape: tuple, dim: Optional[int], replicas: int) -> DTensor:
        """``local`` (shared, not copied) as a DTensor of the global ``full_shape``."""
        mesh = self.mesh(local.device.type, replicas if dim is not None else 1)
        if dim is None:
            placements = [Replicate(), Replicate()]
        elif replicas == 1:
            placements = [Replicate(), Shard(dim)]
        else:
            placements = [Replicate(), Shard(dim), Replicate()]
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(full_shape),
                                  stride=_contiguous_strides(full_shape))


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _local_tensors(layout, optimizer, slot) -> dict[str, torch.Tensor]:
    out = {"model": layout.params[slot.name].detach()}
    out.update(optimizer.tensors(slot.name))
    return out


def sharded_state_dict(layout, optimizer, meshes: Optional[ShardMeshes], *, stage: bool = False,
                       moments: bool = True) -> dict[str, torch.Tensor]:
    """``{"model/NAME", "master/NAME", "exp_avg/NAME", "exp_avg_sq/NAME": tensor}`` of this rank.

    With ``meshes`` the values are DTensors over this rank's shards; without (one process)
    they are the plain tensors.  ``stage=True`` first copies each shard to host memory (an
    asynchronous save writes the copies while training goes on; one shard-sized copy each).
    ``moments=False`` leaves out the optimizer tensors (the model weights only).
    """
    out = {}
    for s in layout.slots:
        for kind, t in _local_tensors(layout, optimizer, s).items():
            if kind != "model" and not moments:
                continue
            if stage:
                t = t.detach().to("cpu", copy=True)
            out[f"{kind}/{s.name}"] = t if meshes is None else meshes.dtensor(t, s.full_shape, s.partition_dim,
                                                                              s.replicas)
    return out


def full_state_dict(shapes: dict[str, tuple], dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Empty full (unsharded) host tensors to read a checkpoint into offline (the export tool)."""
    return {k: torch.empty(shapes[k], dtype=dtypes[k]) for k in shapes}
