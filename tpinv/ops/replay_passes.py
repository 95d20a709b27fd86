"""What a recorded program is reduced to before it runs: the steps nothing reads, dropped, and the
allocations only kernels read, made from one buffer per part of a program.

Invariant kept: every launch and every op that writes device memory is kept, in order, and reads
the values it read before: a pruned step made a tensor nothing reads, a pooled allocation gives a
kernel the same number of bytes at another address (512-byte aligned, as the caching allocator's
blocks are), which only ``tensor address + offset`` arithmetic sees.  So a program after these
passes computes the recorded program's bits.
"""
from __future__ import annotations

import torch

from tpinv.ops.replay import ALLOCATING, Recording, pool_step

__all__ = ["pool_allocations", "prune"]


def prune(steps: list, needed: set) -> list:
    """``steps`` without those whose results nothing after them reads: a pure step (a view, an
    allocation, an out-of-place op) none of whose slots is read later or in ``needed``.  Launches
    and ops that write into a slot they read are kept; what they read is needed."""
    needed, kept = set(needed), []
    for step in reversed(steps):
        if step.pure and not (step.writes & needed):
            continue
        kept.append(step)
        needed |= step.reads
    return kept[::-1]


def pool_allocations(rec: Recording, forward: list, backward: list, outputs: set) -> tuple:
    """``(forward, backward, size)``: the two step lists of ``rec`` with every allocation that only
    launches read made from three pools -- what the backward reads of the forward's (slot
    ``len(rec.slots)``), the forward's scratch (``+ 1``, not saved for the backward) and the
    backward's (``+ 2``) -- and the slot count that holds them.  ``outputs``: slots read as tensors
    after the programs (the output, the gradients)."""
    size = len(rec.slots)
    tensors = outputs.union(*(s.reads for s in forward + backward if s.kind != "launch"))
    for_backward = set().union(*(s.reads for s in backward if s.kind == "launch"))

    def allocations(steps):
        return [next(iter(s.writes)) for s in steps
                if s.kind == "aten" and s.name in ALLOCATING and len(s.writes) == 1 and not s.writes & tensors]

    def nbytes(slot):
        return rec.ranges[slot][3] - rec.ranges[slot][2]

    made_forward, made_backward = allocations(forward), allocations(backward)
    devices = {rec.slots[s].device for s in made_forward + made_backward}
    if len(devices) != 1:
        return forward, backward, size
    pools = [{size: [(s, nbytes(s)) for s in made_forward if s in for_backward],
              size + 1: [(s, nbytes(s)) for s in made_forward if s not in for_backward]},
             {size + 2: [(s, nbytes(s)) for s in made_backward]}]
    forward, backward = _pool([forward, backward], pools, devices.pop())
    return forward, backward, size + 3


def _pool(programs: list, pools: list, device: torch.device) -> list:
    """Each step list of ``programs`` with the allocations of the slots in its ``pools`` entry
    (``{pool slot: [(slot, nbytes), ...]}``) made as one byte buffer per pool, first in that
    program: each slot's allocation step is dropped and every launch (in any of the programs)
    addresses the slot at its offset in its pool, 512-byte aligned as the caching allocator's
    blocks are.  Only slots that nothing but launches reads may be pooled: they need an address,
    not a tensor."""
    where, made = {}, []
    for program_pools in pools:
        made.append([])
        for pool, members in program_pools.items():
            offset = 0
            for slot, nbytes in members:
                where[slot] = (pool, offset)
                offset += -(-max(nbytes, 1) // 512) * 512
            if members:
                made[-1].append(pool_step(pool, offset, device))
    out = []
    for steps, first in zip(programs, made):
        kept = list(first)
        for step in steps:
            if step.kind == "aten" and step.name in ALLOCATING and step.writes and set(step.writes) <= set(where):
                continue
            if step.kind == "launch":
                step.pointers[:] = [(i, *_moved(where, s, d)) for i, s, d in step.pointers]
                step.descs[:] = [(i, *_moved(where, s, d), make) for i, s, d, make in step.descs]
                step.reads = frozenset([s for _, s, _ in step.pointers] + [s for _, s, _, _ in step.descs])
            kept.append(step)
        out.append(kept)
    return out


def _moved(where: dict, slot: int, offset: int) -> tuple:
    if slot not in where:
        return slot, offset
    pool, start = where[slot]
    return pool, start + offset
