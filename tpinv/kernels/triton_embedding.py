"""The embedding weight gradient on CUDA, in token order and without atomics.

Invariant kept (the CPU kernel's, :mod:`tpinv.kernels.reference_embedding`): the gradient of a table
row is the fp32 chain of its tokens' gradients in flattened token order,
``((0 + g_t1) + g_t2) + ...``, rounded once, so a row's bits depend only on its own tokens and
their order -- the same bits as the CPU kernel's, since the chain holds only adds.

How: a stable sort of the ids puts each row's tokens next to each other in token order; the
program at the first token of a run walks the run and adds the gradients one by one (a
sequential loop, not a reduction tree), so no two programs write the same row and nothing is
atomic.  Tokens whose id is ``IGNORED_ID`` (-1) sort first and form a run no program walks.
Sorting and finding the run ends (``searchsorted``) have fixed sizes, so a step needs no host
synchronisation and can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpinv.kernels.launch import cdiv, launch
from tpinv.kernels.reference_embedding import token_runs

__all__ = ["embedding_backward_cuda"]

BLOCK_D = 256   # columns per program; the chain runs down each column, so this is a speed choice


@triton.jit
def _token_order_chain_kernel(g_ptr, order_ptr, sorted_ptr, end_ptr, out_ptr, D, s_g, s_o,
                              BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(sorted_ptr + i)
    prev = tl.load(sorted_ptr + i - 1, mask=i > 0, other=-1)
    if (row != prev) & (row >= 0):  # the first token of its row's run (not the ignored ids')
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        keep = offs < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        end = tl.load(end_ptr + i)
        for j in range(i, end):
            t = tl.load(order_ptr + j)
            acc = acc + tl.load(g_ptr + t * s_g + offs, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * s_o + offs, acc, mask=keep)


def embedding_backward_cuda(grad: torch.Tensor, ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows, dim]`` in ``grad.dtype``: per row, the token-order fp32 chain of its grads
    (tokens with id -1 add to no row); no host synchronization."""
    acc, g, sorted_ids, order = token_runs(grad, ids, num_rows)
    if g is None:
        return acc.to(grad.dtype)
    if g.stride(-1) != 1:
        g = g.contiguous()
    ends = torch.searchsorted(sorted_ids, sorted_ids, right=True)  # one past each run's last token
    tokens, dim = g.shape
    launch(_token_order_chain_kernel, (tokens, cdiv(dim, BLOCK_D)),
        g, order, sorted_ids, ends, acc, dim, g.stride(0), acc.stride(0), BLOCK_D=BLOCK_D, num_warps=4)
    return acc.to(grad.dtype)
