"""Tensor- and data-parallel process groups, built and validated once, passed explicitly.

Layout (TP innermost): the world of ``tp * dp`` ranks is a 2-D :class:`DeviceMesh` of
dimensions ``("dp", "tp")`` and shape ``(dp, tp)``, so TP groups are consecutive ranks
``[d*tp, (d+1)*tp)`` and DP groups have stride ``tp`` ``{j, j+tp, j+2*tp, ...}``.  The layer
path takes the mesh's process groups (``tp_group``, ``dp_group``); the DTensor path takes the
mesh itself (``ParallelState.tp_mesh``): both come from one construction.
The TP size must be a power of two dividing the leaf count, so every TP rank owns whole
sub-trees of the contract's leaf tree and results keep their bits at any TP size.
Nothing here is global: :class:`ParallelState` is a value that callers hand to layers.
"""
from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tpinv.core.contract import DEFAULT_LEAVES, InvarianceError, check_tp_size

__all__ = ["ParallelDims", "ParallelState"]


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"environment variable {name} is not set: start the program with "
                           f"torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) "
                           f"or call torch.distributed.init_process_group first")
    return int(value)


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """The requested parallel sizes: ``tp`` (tensor) and ``dp`` (data; default world // tp)."""

    tp: int
    dp: int | None = None
    leaves: int = DEFAULT_LEAVES

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ValueError(f"tp={self.tp!r} must be a positive int")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ValueError(f"dp={self.dp!r} must be a positive int or None")
        try:
            check_tp_size(self.tp, self.leaves)
        except InvarianceError as exc:
            raise InvarianceError(f"ParallelDims(tp={self.tp}): {exc}") from None

    def resolve(self, world_size: int) -> tuple[int, int]:
        """``(tp, dp)`` for a world of ``world_size`` ranks, or a clear error."""
        if world_size % self.tp:
            raise InvarianceError(
                f"tp={self.tp} does not divide the world size {world_size}; choose tp among "
                f"{[t for t in (1, 2, 4, 8, 16, 32) if t <= self.leaves and world_size % t == 0]} "
                f"or launch a multiple of {self.tp} ranks")
        dp = world_size // self.tp if self.dp is None else self.dp
        if self.tp * dp != world_size:
            raise InvarianceError(f"tp={self.tp} * dp={dp} = {self.tp * dp} ranks, but the world "
                                  f"has {world_size}; set dp={world_size // self.tp} or leave "
                                  f"it out")
        return self.tp, dp

    def build(self, backend: str | None = None,
              timeout: float | datetime.timedelta = 600.0) -> "ParallelState":
        """Create the ``("dp", "tp")`` device mesh and its groups on every rank (a collective call).

        Reads RANK, WORLD_SIZE and LOCAL_RANK (torchrun) and initializes the default
        group if needed, with ``backend`` (default ``"nccl"`` when CUDA is available,
        else ``"gloo"``) and ``timeout`` (seconds or a timedelta).  The mesh's device type
        follows the default group's backend: ``"cuda"`` for NCCL, ``"cpu"`` for gloo.
        """
        if not dist.is_initialized():
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
            self.resolve(world)  # fail before any rendezvous
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            if not isinstance(timeout, datetime.timedelta):
                timeout = datetime.timedelta(seconds=timeout)
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        tp, dp = self.resolve(world)
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
        # row-major (dp, tp): rank = d * tp + t, the TP-innermost layout
        mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
        return ParallelState.from_mesh(mesh, leaves=self.leaves)


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """The groups and coordinates of this rank; pass ``tp_group``/``dp_group`` to layers."""

    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    rank: int
    world_size: int
    leaves: int = DEFAULT_LEAVES
    mesh: DeviceMesh | None = dataclasses.field(default=None, compare=False)

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-D TP sub-mesh of this rank (what :mod:`tpinv.dtensor`'s plans take)."""
        return self._dim("tp")

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The 1-D DP sub-mesh of this rank."""
        return self._dim("dp")

    def _dim(self, name: str) -> DeviceMesh:
        if self.mesh is None:
            raise ValueError("this ParallelState was built from process groups without a DeviceMesh")
        return self.mesh[name]

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, leaves: int = DEFAULT_LEAVES) -> "ParallelState":
        """The state of a 2-D mesh with dimensions ``("dp", "tp")`` (TP innermost: the TP groups' ranks
        consecutive); its groups are the mesh's."""
        if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != ("dp", "tp"):
            raise ValueError(f"expected a 2-D DeviceMesh with mesh_dim_names ('dp', 'tp'), got {mesh!r}")
        tp_size = mesh.size(1)
        try:
            check_tp_size(tp_size, leaves)
        except InvarianceError as exc:
            raise InvarianceError(f"the mesh's tp dimension of size {tp_size}: {exc}") from None
        tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
        return cls(tp_group=tp_group, dp_group=dp_group, tp_rank=mesh.get_local_rank("tp"), tp_size=tp_size,
                   dp_rank=mesh.get_local_rank("dp"), dp_size=mesh.size(0), rank=dist.get_rank(),
                   world_size=dist.get_world_size(), leaves=leaves, mesh=mesh)

    @classmethod
    def from_megatron(cls, leaves: int = DEFAULT_LEAVES) -> "ParallelState":
        """Adopt the TP and DP groups of an initialized ``megatron.core.parallel_state``."""
        try:
            from megatron.core import parallel_state as mpu
        except ImportError as exc:
            raise ImportError("ParallelState.from_megatron needs megatron-core: "
                              "pip install 'tpinv[megatron]'") from exc
        if not dist.is_initialized() or not mpu.model_parallel_is_initialized():
            raise RuntimeError("megatron.core.parallel_state is not initialized: call "
                               "parallel_state.initialize_model_parallel(tensor_model_parallel_"
                               "size=...) after init_process_group, then from_megatron()")
        tp_group = mpu.get_tensor_model_parallel_group()
        dp_group = mpu.get_data_parallel_group()
        tp_size = dist.get_world_size(tp_group)
        try:
            check_tp_size(tp_size, leaves)
        except InvarianceError as exc:
            raise InvarianceError(f"megatron's tensor_model_parallel_size={tp_size}: {exc}") \
                from None
        return cls(tp_group=tp_group, dp_group=dp_group, tp_rank=dist.get_rank(tp_group),
                   tp_size=tp_size, dp_rank=dist.get_rank(dp_group),
                   dp_size=dist.get_world_size(dp_group), rank=dist.get_rank(),
                   world_size=dist.get_world_size(), leaves=leaves,
                   mesh=_mesh_of_groups(dp_group, tp_group))


def _mesh_of_groups(dp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup) -> DeviceMesh:
    """The ``("dp", "tp")`` mesh over existing groups (no new group is created).

    Row ``d`` is the TP group of the ``d``-th member of this rank's DP group: Megatron's layouts
    are products, so that group is this rank's TP group shifted by the member's offset.
    """
    rank = dist.get_rank()
    tp_ranks, dp_ranks = dist.get_process_group_ranks(tp_group), dist.get_process_group_ranks(dp_group)
    layout = torch.tensor([[d + t - rank for t in tp_ranks] for d in dp_ranks], dtype=torch.int64)
    device_type = "cuda" if "nccl" in str(dist.get_backend(tp_group)) else "cpu"
    return DeviceMesh.from_group([dp_group, tp_group], device_type, layout, mesh_dim_names=("dp", "tp"))
