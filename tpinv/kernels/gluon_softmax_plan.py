"""Where and in what shape the held-leaf softmax kernels run (:mod:`tpinv.kernels.gluon_softmax`,
:mod:`tpinv.kernels.gluon_softmax_cluster`): the table and the launch shape.

Invariant kept: none of it moves a bit.  Every choice here -- whether the held kernel runs a
(dtype, mode) at all (:data:`HELD_CONFIG`, :func:`held_plan`), its warps and programs an SM, the
start stagger, whether a row's leaves meet in a cluster (:data:`CLUSTERED`), which of a leaf's
tiles are held in shared memory and which are read from global memory in every pass
(:func:`held_buffers`), and a register cap (:func:`register_cap`) -- changes where and when an
operation runs, never its operands or order; ``tests/gpu/test_softmax_by_leaves.py`` compares
the bytes of each with the row kernel's.  :func:`held_launch_options` turns a plan into the
kernels' constexprs and launch options, kept per shape.
"""
from __future__ import annotations

import functools
import math
import types
from typing import Mapping

import torch

from tpinv.kernels.gluon_softmax_leaf import fold_layout_of, live_tiles, tile_lanes_of
from tpinv.kernels.launch import cdiv

__all__ = ["held_plan", "held_buffers", "register_cap", "held_launch_options", "HELD_CONFIG",
           "CLUSTERED", "PREFETCHED", "SMEM_BUDGET", "REGISTERS_PER_SM", "SM_SHARED", "RESERVED_PER_PROGRAM"]

#: Shared memory a program may hold its leaf in (bytes): two such programs fit an SM.
SMEM_BUDGET = 100 * 1024
#: 32-bit registers of one SM (sm_90).
REGISTERS_PER_SM = 64 * 1024
#: Shared memory of one SM (sm_90, bytes), and what the driver keeps of it for each program.
SM_SHARED = 228 * 1024
RESERVED_PER_PROGRAM = 1024
#: Per (input dtype, mode: 0 the statistics alone, 1 log_softmax, 2 softmax): (num_warps, programs
#: per SM, stagger in ns), from the sweeps in docs/benchmarks.md.  H100 (4096 / 1024 rows, % of
#: copy): fp32 log_softmax 86 / 82, statistics 71 / 66; bf16 at five programs, registers capped by
#: :func:`register_cap`, starts staggered (:func:`~tpinv.kernels.gluon_softmax._stagger`):
#: log_softmax 81 / 78, statistics 66 / 59, against 80 / 72.5 and 60 / 53 all at once; in fp32 a
#: stagger was slower.  H200, with the fold's one exchange
#: (:func:`~tpinv.kernels.gluon_softmax_leaf.fold_lanes`): bf16 log_softmax 75 / 70, statistics
#: 62 / 55; fp32 log_softmax 75 / 72 at 4 warps (8: 72 / 70), statistics 61 / 58 at 8 warps (4:
#: 58 / 54); then with the flush-free exp (:func:`~tpinv.kernels.gluon_softmax_leaf.exp_shifted`):
#: bf16 log_softmax 79 / 74, fp32 80 / 77, statistics 63 / 56 and 71 / 66; softmax, once it divides
#: by the row's reciprocal (:func:`~tpinv.kernels.gluon_softmax_leaf.quotient_by_reciprocal`), bf16
#: 59 / 56 at four programs without a cap (five: 58 / 55), fp32 73 / 70 at 8 warps (4: 72 / 69);
#: then, read by tiles (the last step's empty tiles skipped) and fp32 softmax keeping its exps,
#: bf16 softmax 64.5 / 61.4 at five programs (four: 62.6 / 59.8), fp32 softmax 74.8 / 71.9 at 4
#: warps (8: 72.0 / 69.5), fp32 statistics 75.9 / 69.6 at 4 warps (8: 72.5 / 67.1); then fp32
#: log_softmax and softmax at three programs an SM, two of a leaf's tiles read from memory
#: (:func:`held_buffers`), in a cluster: 84.8 / 82.6 and 83.7 / 79.8 against 81.0 / 78.5 and
#: 79.2 / 75.7 at two (the statistics 83.9 / 76.6 against 85.1 / 78.0: kept at two); then bf16
#: log_softmax's starts 1000 ns apart, 82.5 / 78.0 against 82.3 / 77.1 at 3000 (0: 81.9 / 75.7;
#: four programs an SM 78.2 / 74.5).  None would send the case to the L2 kernel.  Speed only: no
#: choice here moves a bit.
HELD_CONFIG = {
    (torch.float32, 0): (4, 2, 0), (torch.float32, 1): (4, 3, 0), (torch.float32, 2): (4, 3, 0),
    (torch.bfloat16, 0): (4, 5, 2000), (torch.bfloat16, 1): (4, 5, 1000),
    (torch.bfloat16, 2): (4, 5, 2000),
    (torch.float16, 0): (4, 5, 2000), (torch.float16, 1): (4, 5, 1000),
    (torch.float16, 2): (4, 5, 2000),
}
#: The (input dtype, mode) whose rows meet in a thread-block cluster
#: (:mod:`tpinv.kernels.gluon_softmax_cluster`; rows of up to eight leaves) rather than through
#: global memory; H200, % of copy at 4096 / 1024 rows, same call: bf16 softmax 72.4 / 69.6 against
#: 64.7 / 61.6, fp32 log_softmax 81.4 / 77.6 against 78.8 / 76.3, fp32 softmax 78.2 / 74.3 against
#: 74.6 / 72.0; the statistics, meeting once in a cluster as here (their sums to global slots,
#: :func:`~tpinv.kernels.triton_softmax_combine.combine_sums` after): fp32 85.9 / 78.4 against 76.0 / 70.0
#: (77.7 / 68.5 meeting twice); slower in a cluster: bf16 log_softmax (79.4 against 81.7 at 4096
#: rows), bf16 statistics (63.7 / 58.3 against 68.6 / 59.7); then the statistics' totals taken in
#: the cluster kernel (the previous row's sums carried by the next row's meeting, no combine launch):
#: fp32 logsumexp 86.3 / 79.7 against 85.9 / 78.5; then, the max pass reading each step as it lands
#: (:func:`~tpinv.kernels.gluon_softmax_extremes.leaf_extremes`), bf16 log_softmax in a cluster
#: copying its next row during the output pass (:data:`PREFETCHED`): 85.0 / 80.8-81.1 against
#: 83.5 / 79.3-79.5 with tickets (bf16 statistics still slower in a cluster: 65.4 / 59.5 against
#: 70.7-70.9 / 62.3 before the change); then, the meetings as asynchronous stores on mbarriers
#: (no release fence), 2026-12-05, % of copy at 1024 / 4096 rows: bf16 statistics in a cluster
#: 71.8-73.8 / 86.1-87.3 against 58.0-60.5 / 80.3-80.4 with tickets (replayed from a CUDA graph
#: 79.7 / 87.7 against 75.0-75.1 / 82.3), so 16-bit statistics meet in a cluster too (fp16 as
#: bf16: the same program shape).  Speed only: the same bits either way.
CLUSTERED = frozenset({(torch.float32, 0), (torch.float32, 1), (torch.float32, 2),
                       (torch.bfloat16, 0), (torch.float16, 0), (torch.bfloat16, 1),
                       (torch.float16, 1), (torch.bfloat16, 2), (torch.float16, 2)})
#: The clustered (input dtype, mode) whose programs copy the cluster's next row into their leaf
#: tile by tile during the output pass, each tile as soon as the pass has written its output
#: (:func:`~tpinv.kernels.gluon_softmax._write_leaf`), rather than after the whole row.  H200, %
#: of copy at 1024 / 4096 rows, same call, two runs each: bf16 softmax 71.3-71.4 / 73.6-73.7
#: against 68.7-68.8 / 71.5, fp32 log_softmax 84.0-84.2 / 86.2-86.3 against 82.5-82.6 /
#: 84.7-84.9; slower for fp32 softmax (78.4-78.6 / 80.7-80.8 against 81.0-81.1 / 83.6-83.7: not
#: here); fp16 as bf16 (the same program shape, not timed); then 16-bit log_softmax (above); the
#: statistics copying during their sum pass instead were slower (fp32 71.0-71.3 / 75.2-76.3
#: against 79.6-79.7 / 86.1: a block barrier before each tile's copies).  Speed only: the same
#: bits.
PREFETCHED = frozenset({(torch.float32, 1), (torch.bfloat16, 1), (torch.float16, 1),
                        (torch.bfloat16, 2), (torch.float16, 2)})


def _powers(steps: int) -> tuple[int, int, int]:
    """``steps`` as ``A + B + C``, powers of two from the largest (0 where unused)."""
    parts = [1 << i for i in reversed(range(steps.bit_length())) if steps >> i & 1]
    return tuple(parts + [0] * (3 - len(parts)))


def held_buffers(steps: int, block: int, tile: int, live: int, element_size: int,
                 per_sm: float) -> tuple[int, int, int, int]:
    """``(A, B, C_LANES, HELD)``: the leaf's ``steps`` held in three power-of-two shared buffers,
    ``A`` and ``B`` steps and ``C_LANES`` lanes, so that ``per_sm`` programs share one SM's
    :data:`SM_SHARED`.  Where the whole leaf fits a program's share, ``HELD`` is every ``live``
    tile of the last step; else the steps before the last are held (where they are at most two
    powers of two) with the last step's first ``HELD`` tiles (a power of two) in the third
    buffer, and its other tiles are read from global memory in every pass
    (:func:`~tpinv.kernels.gluon_softmax_leaf.tile_in_memory`; an fp32 Qwen3 leaf at three
    programs an SM: 4 steps and 4 of the last step's 6 tiles held, 560 of 18,992 elements
    read from memory).  Where neither fits, the whole leaf (the driver then places fewer
    programs).  Speed only: where an element is read from moves no bit."""
    a, b, c = _powers(steps)
    whole = (a, b, c * block if c else 16, live)
    share = (SM_SHARED // math.ceil(per_sm) - RESERVED_PER_PROGRAM
             - 4 * tile - 256)   # beside the leaf: the fold's exchange, a cluster's slots
    if steps * block * element_size <= share:
        return whole
    a, b, c = _powers(steps - 1)
    room = share - (steps - 1) * block * element_size
    if c or room < tile * element_size:
        return whole
    held = 1 << (min(live, room // (tile * element_size)).bit_length() - 1)
    return a, b, held * tile, held


def held_plan(rows: torch.Tensor, leaves: int, block: int, mode: int,
              config: tuple | None = None) -> tuple | None:
    """``(num_warps, programs per SM, stagger_ns)`` for ``rows`` cut in ``leaves`` in ``mode`` (0:
    the statistics alone, 1: log_softmax, 2: softmax), or None where this kernel does not run
    them: the table says the L2 kernel is faster, a leaf's steps are not three powers of two, or
    a leaf does not fit :data:`SMEM_BUDGET`.  ``config`` overrides the table."""
    config = config or HELD_CONFIG.get((rows.dtype, mode))
    steps = cdiv(rows.shape[1] // leaves, block)
    if (config is None or bin(steps).count("1") > 3
            or steps * block * rows.element_size() > SMEM_BUDGET):
        return None
    return config


def register_cap(num_warps: int, per_sm: float) -> int | None:
    """The registers a thread may use so that ``per_sm`` programs of ``num_warps`` fit one SM's
    :data:`REGISTERS_PER_SM` (allocated in eights), or None where 128 or more fit: the kernel's
    own allocation (113-127 at 4 warps, 59-64 at 8; sm_90, Triton 3.6) needs no cap there.
    Speed only: a cap moves registers to local memory, never an operation."""
    budget = REGISTERS_PER_SM // (math.ceil(per_sm) * num_warps * 32) // 8 * 8
    return None if budget >= 128 else budget


@functools.lru_cache(maxsize=256)
def held_launch_options(element_size: int, leaf_len: int, leaves: int, mode: int, block: int,
                        num_warps: int, per_sm: float, stagger_ns: int,
                        lse: bool | None = None, prefetch: bool | None = None) -> Mapping:
    """The held kernel's constexprs and launch options for leaves of ``leaf_len`` elements of
    ``element_size`` bytes (what :func:`~tpinv.kernels.gluon_softmax.softmax_rows_held` launches
    with), kept per shape and read-only; with ``lse`` and ``prefetch`` (the cluster kernel's),
    its ``LSE`` (the statistics write each row's logsumexp) and ``PREFETCH`` (the next row is
    copied during the output pass: :data:`PREFETCHED`)."""
    steps = cdiv(leaf_len, block)
    vec = 16 // element_size
    tile = tile_lanes_of(vec, num_warps, block)
    live, partial = live_tiles(leaf_len, block, tile)
    a, b, c_lanes, held = held_buffers(steps, block, tile, live, element_size, per_sm)
    cap = register_cap(num_warps, per_sm)
    stagger = math.ceil(per_sm) if stagger_ns > 0 and per_sm > 1 else 0   # started in turn
    return types.MappingProxyType(dict(
        MODE=mode, LEAVES=leaves, LOG2_LEAVES=leaves.bit_length() - 1, BLOCK=block, TILE=tile,
        LOG2_TILE=tile.bit_length() - 1, LIVE=live, PARTIAL=partial, HELD=held, STEPS=steps,
        A=a, B=b, C_LANES=c_lanes,
        VEC=vec, STAGGER=stagger, fold_layout=fold_layout_of(tile, num_warps),
        num_warps=num_warps, enable_fp_fusion=False, **({} if cap is None else {"maxnreg": cap}),
        **({} if lse is None else {"LSE": lse}),
        **({} if prefetch is None else {"PREFETCH": prefetch})))
