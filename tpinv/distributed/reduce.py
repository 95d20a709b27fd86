"""The tree reducer: combine fp32 partials across a process group in the contract's order.

Invariant: each rank of a group of size ``C`` holds the fp32 partial of its leaves'
sub-tree; the result is :func:`tpinv.core.contract.tree_combine` of the ``C`` partials in
group-rank order, ``((p0+p1)+(p2+p3))+...`` -- the top of the leaf tree -- so it has the
same bits as the single-process tree, at every ``C`` and with every algorithm.  Every
add is an exact elementwise IEEE add with the lower rank's value on the left.

Algorithms (all give identical bits):

* ``"all_to_all"``: flatten, pad to a multiple of ``C``, ``all_to_all_single`` so each
  rank receives the ``C`` partials of its ``1/C`` of the elements, tree over them in rank
  order, ``all_gather`` back.  ``2(C-1)/C * n`` elements per rank, like a ring all-reduce.
* ``"halving"``: recursive halving reduce-scatter (partner distance 1, 2, 4, ... so the
  pair sums are the adjacent-pair tree), then recursive doubling all-gather, point to
  point.  Same bytes in ``2 log C`` steps (the paper's variant; opt-in, see below).
* ``"all_gather"``: gather every partial, tree locally.  ``(C-1) * n`` elements, one
  step; the latency-optimal choice for tiny messages.
* ``"pair_sum"``: groups of two ranks only.  There the whole tree is one IEEE add,
  ``p0 + p1``, and addition is commutative, so any correct sum of the two fp32 values
  has its bits: the backend's own ``all_reduce`` / ``reduce_scatter_tensor`` (NCCL's
  fused reduction, at NCCL's speed) is the tree.  Other group sizes raise
  :class:`InvarianceError` (three or more operands: the backend's order is not the tree).
* ``"auto"``: ``"pair_sum"`` for two NCCL ranks, else by message size, see
  :func:`choose_algorithm` (thresholds measured with ``benchmarks/bench_reduce.py``).

Every call first checks that the group's ranks agree on it (``check=True``, the default: each call
signature once per rank and group; ``check="always"``: every call), and a failed transport raises
:class:`CollectiveError`: :mod:`tpinv.distributed.collective_calls`.

Only torch.distributed collectives are used (gloo and NCCL).  These functions are not
differentiable; :mod:`tpinv.distributed.mappings` wraps them in autograd regions.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpinv.core.contract import DEFAULT_LEAVES, InvarianceError, check_tp_size, tree_combine_list
from tpinv.distributed.collective_calls import (CHECK_ENV, CHECK_MODES, CollectiveError, all_gather_single,
                                               check_agree, check_mode, collective_errors)
from tpinv.distributed.groups import LOCAL, group_size, group_size_rank

__all__ = ["ALGORITHMS", "CHECK_ENV", "CHECK_MODES", "CollectiveError", "tree_all_reduce", "tree_reduce_scatter",
           "all_gather", "gather_shards", "algorithms_for", "check_mode", "choose_algorithm"]

ALGORITHMS = ("all_to_all", "halving", "all_gather", "pair_sum")
_ALGORITHM_CODES = ("auto",) + ALGORITHMS   # the cross-rank check's codes for ``algorithm``

#: ``"auto"`` runs ``"all_gather"`` while the bytes a rank receives, ``(C-1) * nbytes``,
#: stay within this bound, else ``"all_to_all"``.  Measured with benchmarks/bench_reduce.py on
#: 2x H200 (NCCL): all_gather beat all_to_all up to 16 MiB, tied at 64 MiB, lost at
#: 256 MiB.  ``"halving"`` was the slowest at every size on NCCL (2 ranks) and on gloo
#: (a point-to-point exchange costs several collective latencies), so auto never picks it.
AUTO_ALL_GATHER_MAX_BYTES = {"gloo": 512 * 1024, "nccl": 16 * 1024 * 1024}

def algorithms_for(group_size: int) -> tuple[str, ...]:
    """The algorithms a group of ``group_size`` ranks may run (``"pair_sum"``: two ranks only)."""
    return tuple(a for a in ALGORITHMS if a != "pair_sum" or group_size == 2)


def choose_algorithm(nbytes: int, group_size: int, backend: str = "gloo") -> str:
    """The algorithm ``"auto"`` runs for a partial of ``nbytes`` bytes per rank.

    ``backend`` is ``"nccl"`` for CUDA tensors, else ``"gloo"``.  A pure function of its
    arguments, so every rank of a group picks the same algorithm.
    """
    if group_size == 2 and backend == "nccl":
        return "pair_sum"
    limit = AUTO_ALL_GATHER_MAX_BYTES["nccl" if backend == "nccl" else "gloo"]
    return "all_gather" if (group_size - 1) * nbytes <= limit else "all_to_all"


def _group(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(group, size, rank)``; ``None`` follows :mod:`tpinv.distributed.groups` (a single rank)."""
    if group is not None and group is not LOCAL and not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group "
                           "(or tpinv.distributed.parallel.ParallelDims.build) before a tree collective")
    size, rank = group_size_rank(group, "group")
    return group, size, rank


def _prepare(op, partial, group, *, algorithm, leaves, check, dim=0):
    """Validation shared by the reducing collectives; returns ``(group, size, rank, algorithm)``
    with ``"auto"`` resolved by :func:`choose_algorithm`."""
    group, size, rank = _group(group)
    check_tp_size(size, leaves)
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: expected 'auto' or one of {ALGORITHMS}")
    mode = check_mode(check)
    if size > 1 and mode:
        check_agree(op, partial, group, size, rank, algorithm=algorithm, algorithms=_ALGORITHM_CODES,
                    leaves=leaves, dim=dim, mode=mode)
    if algorithm != "auto" and algorithm not in algorithms_for(size):
        raise InvarianceError(
            f"{op}: algorithm 'pair_sum' needs a group of exactly 2 ranks (the tree is then one "
            f"add), got {size}; use 'auto', 'all_to_all', 'halving' or 'all_gather'")
    if partial.dtype != torch.float32:  # after the exchange, so every rank raises alike
        raise TypeError(f"{op} combines fp32 partials, got {partial.dtype} of shape "
                        f"{tuple(partial.shape)}; accumulate the local sub-tree in fp32 and "
                        f"round to the output dtype once, after the reduction")
    if algorithm == "auto":
        backend = "nccl" if partial.is_cuda else "gloo"
        algorithm = choose_algorithm(partial.numel() * 4, size, backend)
    return group, size, rank, algorithm


def _exchange(send: torch.Tensor, recv: torch.Tensor, partner: int, group) -> None:
    peer = dist.get_global_rank(group, partner)
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _halving(buf: torch.Tensor, group, size: int, rank: int) -> tuple[int, int, list]:
    """Recursive halving in place on a flat buffer; returns this rank's window and the steps."""
    lo, hi, steps, distance = 0, buf.numel(), [], 1
    while distance < size:
        mid = (lo + hi) // 2
        upper = bool(rank & distance)
        keep, give = ((mid, hi), (lo, mid)) if upper else ((lo, mid), (mid, hi))
        recv = torch.empty(keep[1] - keep[0], dtype=buf.dtype, device=buf.device)
        _exchange(buf[give[0]:give[1]], recv, rank ^ distance, group)
        mine = buf[keep[0]:keep[1]]
        mine.copy_(recv + mine if upper else mine + recv)  # the lower rank's value on the left
        steps.append((lo, hi, rank ^ distance))
        (lo, hi), distance = keep, distance * 2
    return lo, hi, steps


def _doubling(buf: torch.Tensor, window: tuple[int, int], steps: list, group) -> None:
    """Recursive doubling all-gather in place: undo the halving steps, last first."""
    lo, hi = window
    for step_lo, step_hi, partner in reversed(steps):
        other = (step_lo, lo) if lo > step_lo else (hi, step_hi)
        _exchange(buf[lo:hi], buf[other[0]:other[1]], partner, group)
        lo, hi = step_lo, step_hi


def _bit_reverse(i: int, size: int) -> int:
    bits = size.bit_length() - 1
    return int(format(i, f"0{bits}b")[::-1], 2) if bits else 0


def _reduce_scatter_rows(rows: torch.Tensor, group, size: int, rank: int, algorithm: str):
    """``rows[j]`` is this rank's partial of chunk ``j``; returns the tree of chunk ``rank``."""
    if algorithm == "pair_sum":
        mine = torch.empty_like(rows[0])
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(mine.view(-1), rows.contiguous().view(-1), op=dist.ReduceOp.SUM, group=group)
        return mine
    if algorithm == "all_to_all":
        received = torch.empty_like(rows)
        dist.all_to_all_single(received, rows, group=group)
        return tree_combine_list(list(received.unbind(0)))
    if algorithm == "all_gather":
        every = torch.empty((size,) + tuple(rows.shape), dtype=rows.dtype, device=rows.device)
        all_gather_single(every, rows, group)
        return tree_combine_list(list(every[:, rank].unbind(0)))
    # Halving leaves rank r the window at bit_reverse(r): lay chunk r out there.
    order = [_bit_reverse(p, size) for p in range(size)]
    buf = rows[order].reshape(-1)
    lo, hi, _ = _halving(buf, group, size, rank)
    return buf[lo:hi].clone()


def tree_all_reduce(partial: torch.Tensor, group: dist.ProcessGroup | None, *,
                    algorithm: str = "auto", leaves: int = DEFAULT_LEAVES,
                    check: bool | str = True) -> torch.Tensor:
    """Tree-combine the fp32 ``partial`` of every rank of ``group`` (``None``: a single rank, see
    :mod:`tpinv.distributed.groups`).

    Returns a contiguous tensor of ``partial``'s shape, bitwise equal to
    ``tree_combine(torch.stack(partials, -1))`` in one process.  A group of one returns
    ``partial`` itself.  The group size must be a power of two dividing ``leaves``.
    With ``check`` every rank first exchanges (shape, dtype, settings) so a mismatch
    raises :class:`InvarianceError` on every rank instead of hanging: once per call
    signature, or every call with ``check="always"`` (see the module docstring).
    """
    group, size, rank, algorithm = _prepare("tree_all_reduce", partial, group,
                                            algorithm=algorithm, leaves=leaves, check=check)
    n = partial.numel()
    if size == 1:
        return partial
    if n == 0:
        return torch.empty_like(partial, memory_format=torch.contiguous_format)
    flat = partial.detach().reshape(-1)
    with torch.no_grad(), collective_errors("tree_all_reduce", algorithm, size, rank):
        if algorithm == "pair_sum":
            out = flat.clone()
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        elif algorithm == "all_gather":
            every = torch.empty((size, n), dtype=flat.dtype, device=flat.device)
            all_gather_single(every, flat.contiguous(), group)
            out = tree_combine_list(list(every.unbind(0)))
        else:
            m = -(-n // size)
            if algorithm == "halving" or size * m != n:  # a fresh buffer: halving works in place
                buf = torch.zeros(size * m, dtype=flat.dtype, device=flat.device)
                buf[:n] = flat
            else:
                buf = flat.contiguous()
            if algorithm == "halving":
                lo, hi, steps = _halving(buf, group, size, rank)
                _doubling(buf, (lo, hi), steps, group)
                out = buf[:n]
            else:
                mine = _reduce_scatter_rows(buf.view(size, m), group, size, rank, algorithm)
                out = torch.empty(size * m, dtype=buf.dtype, device=buf.device)
                all_gather_single(out, mine, group)
                out = out[:n]
    return out.reshape(partial.shape).contiguous()


def tree_reduce_scatter(partial: torch.Tensor, group: dist.ProcessGroup | None, *, dim: int = 0,
                        algorithm: str = "auto", leaves: int = DEFAULT_LEAVES,
                        check: bool | str = True) -> torch.Tensor:
    """Chunk ``rank`` along ``dim`` of :func:`tree_all_reduce` of ``partial`` (same bits).

    ``partial.shape[dim]`` must be divisible by the group size ``C``; the result has
    that dimension divided by ``C``.  ``"auto"`` chooses as for :func:`tree_all_reduce`
    (on the whole partial); ``"halving"`` is available too.
    """
    dim = _check_dim("tree_reduce_scatter", partial, dim)
    group, size, rank, algorithm = _prepare("tree_reduce_scatter", partial, group,
                                            algorithm=algorithm, leaves=leaves, check=check,
                                            dim=dim)
    if size == 1:
        return partial
    length = partial.shape[dim]
    if length % size:
        expected = list(partial.shape)
        expected[dim] = f"multiple of {size}"
        raise InvarianceError(
            f"tree_reduce_scatter over {size} ranks splits dim {dim} of shape "
            f"{tuple(partial.shape)} into equal chunks; expected shape {expected}")
    moved = partial.detach().movedim(dim, 0)
    rest = tuple(moved.shape[1:])
    if partial.numel() == 0:
        return torch.empty((length // size,) + rest, dtype=partial.dtype,
                           device=partial.device).movedim(0, dim).contiguous()
    with torch.no_grad(), collective_errors("tree_reduce_scatter", algorithm, size, rank):
        rows = moved.contiguous().reshape(size, -1)
        mine = _reduce_scatter_rows(rows, group, size, rank, algorithm)
    return mine.reshape((length // size,) + rest).movedim(0, dim).contiguous()


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None, *, dim: int = 0,
               check: bool | str = True) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in group-rank order, exactly (any dtype).

    The bytes travel unchanged.  A group of one returns ``tensor`` itself.
    """
    dim = _check_dim("all_gather", tensor, dim)
    mode = check_mode(check)
    group, size, rank = _group(group)
    if size == 1:
        return tensor
    if mode:
        check_agree("all_gather", tensor, group, size, rank, algorithm="auto",
                    algorithms=_ALGORITHM_CODES, leaves=1, dim=dim, mode=mode)
    moved = tensor.detach().movedim(dim, 0).contiguous()
    raw = moved.reshape(-1).view(torch.uint8)
    out = torch.empty(size * raw.numel(), dtype=torch.uint8, device=raw.device)
    with torch.no_grad(), collective_errors("all_gather", "all_gather", size, rank):
        if raw.numel():
            all_gather_single(out, raw, group)
    out = out.view(tensor.dtype).reshape((size * moved.shape[0],) + tuple(moved.shape[1:]))
    return out.movedim(0, dim).contiguous()


def gather_shards(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int,
                  replicas: int = 1) -> torch.Tensor:
    """The full tensor of a TP shard: :func:`all_gather` along ``dim``, keeping one copy of each
    shard when ``replicas`` consecutive ranks hold the same one (replicated KV heads)."""
    full = all_gather(tensor.detach().contiguous(), group, dim=dim)
    if replicas == 1 or full is tensor:
        return full
    return torch.cat(full.chunk(group_size(group), dim=dim)[::replicas], dim=dim)


def _check_dim(op: str, t: torch.Tensor, dim: int) -> int:
    if t.dim() == 0:
        raise ValueError(f"{op} splits or joins a dimension; got a 0-dim tensor, expected shape "
                         f"with at least one dimension")
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"{op}: dim={dim} is out of range for shape {tuple(t.shape)}")
    return dim % t.dim()
