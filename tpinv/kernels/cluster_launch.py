"""Launching a compiled kernel as thread-block clusters (sm_90): programs resident together.

Invariant kept: the kernel that runs is the one Triton compiles for the arguments
(``kernel.warmup``: the same specialization ``kernel[grid](...)`` would build); only its launch
differs: every ``cluster_size`` consecutive programs form one cluster (the CUDA launch attribute
Triton's own launcher sets from a compiled kernel's CTA count), so the hardware places a cluster's
programs on the SMs of one GPC at the same time and they may wait for one another (a cluster
barrier) and write to one another's shared memory.  The kernel is compiled for one CTA a program
(its layouts hold no CTA split); a program finds its rank in its cluster as
``program_id(0) % cluster_size`` and its cluster as ``program_id(0) // cluster_size``.  A launch
is a bound launch (:func:`tpinv.kernels.launch.run_entry`: the launcher's C entry where it has
one), with the cluster's launch metadata, and a recording of launches (:mod:`tpinv.ops.replay`)
is told of it as of any other.

Written for Triton 3.6's launcher (a compiled kernel's ``packed_metadata`` is ``(num_warps,
num_ctas, shared)``, and its driver can ask the occupancy of clusters); another form raises a
clear error rather than launching something else.
"""
from __future__ import annotations

import copy
from typing import Mapping

from tpinv.kernels.launch import (RECORDER, _current_device, _direct_entry, _specialization,
                                  remember, run_entry)

__all__ = ["clustered", "ClusteredKernel"]

_CLUSTERED: dict = {}   # (device, id(kernel), specialization, options, cluster size) -> ClusteredKernel


class ClusteredKernel:
    """A compiled kernel launched as clusters of ``cluster_size`` programs; ``max_clusters`` of
    them fit the GPU at once (the driver's occupancy for its registers and shared memory);
    ``tail``: its constexprs' values, passed after the runtime arguments of every launch."""

    def __init__(self, kernel, compiled, cluster_size: int, tail: tuple = ()):
        packed = getattr(compiled, "packed_metadata", None)
        if not (isinstance(packed, tuple) and len(packed) == 3 and packed[1] == 1):
            raise RuntimeError(
                "launching as clusters needs Triton 3.6's launcher form (packed metadata "
                f"(num_warps, num_ctas=1, shared)); this Triton packs {packed!r}")
        from triton.runtime.driver import driver
        occupancy = getattr(driver.active.utils, "cuOccupancyMaxActiveClusters", None)
        if occupancy is None:
            raise RuntimeError("this Triton's driver cannot ask the occupancy of clusters")
        self.compiled = copy.copy(compiled)          # the JIT's own object keeps launching alone
        self.compiled.packed_metadata = (packed[0], cluster_size, packed[2])
        self.cluster_size = cluster_size
        self.max_clusters = int(occupancy(compiled.function, compiled.metadata.shared, cluster_size))
        if self.max_clusters < 1:
            raise RuntimeError(f"not one cluster of {cluster_size} programs fits this GPU "
                               f"({compiled.metadata.shared} bytes of shared memory a program)")
        # kept as launch.py keeps a bound kernel: the constexpr tail, its launcher's C entry
        self.entry = (self.compiled, tuple(tail), _direct_entry(self.compiled), kernel)

    def launch(self, n_clusters: int, args: tuple) -> None:
        """``n_clusters`` clusters (``n_clusters * cluster_size`` programs) over ``args`` (the
        kernel's runtime arguments, in order), as :func:`~tpinv.kernels.launch.launch` launches
        a bound kernel: a recording of launches (:data:`tpinv.kernels.launch.RECORDER`) is told
        of it, with the cluster's launch metadata, as of any bound launch."""
        grid = (n_clusters, 1, 1)
        full = (*args, *self.entry[1])
        recorder = RECORDER[0]
        if recorder is not None:
            recorder.launch(self.entry, grid, full)
        run_entry(self.entry, grid, full, _current_device())


def clustered(kernel, args: tuple, options: Mapping, cluster_size: int) -> ClusteredKernel:
    """``kernel`` compiled for ``args`` and ``options`` (constexprs and launch options), kept per
    device and specialization, ready to launch as clusters of ``cluster_size`` programs."""
    key = (_current_device(), id(kernel), _specialization(args), tuple(options.items()), cluster_size)
    entry = _CLUSTERED.get(key)
    if entry is None:
        compiled = kernel.warmup(*args, grid=(1,), **options)
        compiled._init_handles()
        tail = tuple(options[name] for name in kernel.arg_names[len(args):])
        entry = remember(_CLUSTERED, key, ClusteredKernel(kernel, compiled, cluster_size, tail))
    return entry

