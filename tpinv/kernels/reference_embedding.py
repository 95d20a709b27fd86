"""Embedding lookup and its gradient in a fixed order on CPU.

The lookup is a gather: exact, no arithmetic.  The gradient of a table row is the sum
of the output gradients of the tokens that hit it, accumulated in fp32 as a sequential
chain in flattened token order, ``((0 + g_t1) + g_t2) + ...``, rounded once to the
gradient's dtype.  A row's bits therefore depend only on its own tokens' gradients and
their order, never on which other rows are hit, on the batch size or on threads.

Fast path: tokens are stably sorted by id, and step ``j`` adds, for every row at once,
its ``j``-th token (in token order).  Each row receives at most one add per step, so
every step is a collision-free gather / add / scatter and the per-row order is the
token order.  The number of steps is the largest multiplicity of an id.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from tpinv.core.contract import SUPPORTED_DTYPES
from tpinv.core.capture import assert_range, capturing, value_range

_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
#: A token whose id is IGNORED_ID adds to no row of the weight gradient (a vocabulary-parallel
#: layer's token of another rank's shard): the same bits as leaving the token out.
IGNORED_ID = -1


def check_ids(ids: torch.Tensor, num_rows: int, ignored: bool = False) -> None:
    """``ids`` must be an integer tensor with every value in ``[0, num_rows)`` (with ``ignored``,
    :data:`IGNORED_ID` too).

    On the CPU the range is read in one transfer and a bad id raises :class:`IndexError` naming
    it.  On CUDA nothing is read on the host (a read would make the host wait for the device):
    the range is asserted on the device (``torch._assert_async``), so a bad id stops the process
    with a device-side assert at its next synchronisation.  The model's own ids reach this check
    already validated (:class:`tpinv.layers.embedding.VocabParallelEmbedding` checks its input
    on the host, with an :class:`IndexError`); the backward's are derived from them.  Inside a
    CUDA-graph capture nothing is checked (the captured step's runner checks its inputs)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a tensor, got {type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        names = ", ".join(str(d) for d in _ID_DTYPES)
        raise TypeError(f"ids must have an integer dtype ({names}), got {ids.dtype}")
    if not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative int, got {num_rows!r}")
    low = IGNORED_ID if ignored else 0
    if ids.is_cuda:
        if not capturing() and not is_fake(ids):
            assert_range(ids, low, num_rows, "embedding id", "checked on the device")
        return
    bounds = value_range(ids)   # None when empty
    if bounds is not None and (bounds[0] < low or bounds[1] >= num_rows):
        value = int(ids[(ids < low) | (ids >= num_rows)].reshape(-1)[0])
        raise IndexError(f"embedding id {value} is out of range for a table of num_rows={num_rows} "
                         f"rows; expected every id in [{low}, {num_rows})")


def check_weight(weight: torch.Tensor) -> tuple[int, int]:
    """``weight`` must be a 2-D ``[num_rows, dim]`` float table; returns its shape."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape [num_rows, dim], got shape {list(weight.shape)}")
    if weight.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"weight dtype {weight.dtype} is not supported; use one of {names}")
    return weight.shape[0], weight.shape[1]


def check_backward_inputs(grad: torch.Tensor, ids: torch.Tensor, num_rows: int) -> int:
    """``grad [*ids.shape, dim]`` float and valid ``ids`` (:data:`IGNORED_ID` allowed); returns ``dim``."""
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"grad must be a tensor, got {type(grad).__name__}")
    if grad.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"grad dtype {grad.dtype} is not supported; use one of {names}")
    check_ids(ids, num_rows, ignored=True)
    if grad.dim() != ids.dim() + 1 or grad.shape[:-1] != ids.shape:
        raise ValueError(f"grad has shape {list(grad.shape)} but ids has shape {list(ids.shape)}: "
                         f"expected grad [{', '.join(str(s) for s in ids.shape)}{', ' if ids.dim() else ''}dim]")
    return grad.shape[-1]


def embedding_forward(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]``: shape ``[*ids.shape, dim]``, same dtype, exact."""
    num_rows, dim = check_weight(weight)
    check_ids(ids, num_rows)
    return weight.index_select(0, ids.reshape(-1).long()).reshape(*ids.shape, dim)


def token_runs(grad: torch.Tensor, ids: torch.Tensor, num_rows: int, drop_ignored: bool = False):
    """Checked inputs laid out for a token-order gradient: ``(acc, g, sorted_ids, order)`` --
    the fp32 zero table ``[num_rows, dim]``, the gradient as ``[tokens, dim]``, and the stable
    sort of the flat ids (equal ids keep token order; :data:`IGNORED_ID` tokens first, or, with
    ``drop_ignored``, left out by a boolean index); ``g`` is None when nothing is added."""
    dim = check_backward_inputs(grad, ids, num_rows)
    flat_ids = ids.reshape(-1).long()
    acc = torch.zeros(num_rows, dim, dtype=torch.float32, device=grad.device)
    g = grad.reshape(flat_ids.numel(), dim)
    if drop_ignored and flat_ids.numel():
        keep = flat_ids != IGNORED_ID
        g, flat_ids = g[keep], flat_ids[keep]
    if flat_ids.numel() == 0 or dim == 0:
        return acc, None, None, None
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    return acc, g, sorted_ids, order


def embedding_backward(grad: torch.Tensor, ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows, dim]`` in ``grad.dtype``: per row, the token-order fp32 chain of its grads
    (tokens with :data:`IGNORED_ID` add to no row)."""
    acc, g, sorted_ids, order = token_runs(grad, ids, num_rows, drop_ignored=True)
    if g is None:
        return acc.to(grad.dtype)
    g, tokens = g.float(), g.shape[0]
    _, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rank = torch.arange(tokens, device=grad.device) - first    # occurrence number of the token
    by_rank = torch.sort(rank, stable=True).indices            # step j: every row's j-th token
    sizes = torch.bincount(rank).tolist()
    start = 0
    for size in sizes:
        pick = by_rank[start:start + size]
        start += size
        rows = sorted_ids[pick]                                  # distinct within a step
        acc.index_copy_(0, rows, acc.index_select(0, rows) + g.index_select(0, order[pick]))
    return acc.to(grad.dtype)


def embedding_backward_reference(grad: torch.Tensor, ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The definition as a Python loop over tokens (small inputs only)."""
    dim = check_backward_inputs(grad, ids, num_rows)
    flat_ids = ids.reshape(-1).tolist()
    g = grad.reshape(len(flat_ids), dim).float()
    acc = torch.zeros(num_rows, dim, dtype=torch.float32, device=grad.device)
    for t, row in enumerate(flat_ids):
        if row != IGNORED_ID:
            acc[row] = acc[row] + g[t]
    return acc.to(grad.dtype)
