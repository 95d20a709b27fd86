"""Fixed-order CPU reductions: the contract's leaf chain, exact on any shape.

``leaf_tree_sum(x, leaves)`` reduces the last dimension of an fp32 tensor: each of
the ``leaves`` contiguous leaves is zero-padded to a power of two and reduced by
contiguous halving (``v[:h] + v[h:]`` until one element is left); the leaf results
are then combined by :func:`tpinv.core.contract.tree_combine`.  Every step is an exact
elementwise add, so each output element's bits depend only on the values of its own
row and the leaf length -- never on the other rows, the batch size, strides, chunking
or the number of threads.  Zero padding on the right is an exact identity, so a row
padded to a longer length gives the same value (up to the sign of an all-zero sum).
On CUDA, :func:`halving_sum` of an fp32 tensor runs the same adds in one Triton launch
(:mod:`tpinv.kernels.triton_tree`) instead of one tensor add per level.
"""
from __future__ import annotations

import torch

from tpinv.core.contract import check_divisible, check_leaves, tree_combine


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def halving_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum the last dim (any length) by contiguous halving over a zero-padded power of two."""
    if x.is_cuda and x.dtype == torch.float32 and x.dim() >= 1:
        from tpinv.kernels.triton_tree import halving_sum_cuda   # imports Triton: CUDA only
        return halving_sum_cuda(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1])
    n = x.shape[-1]
    p = _next_pow2(n)
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x.squeeze(-1)


def _check_fp32(x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"leaf reductions run in fp32, got {x.dtype}")


def leaf_partials(x: torch.Tensor, leaves: int) -> torch.Tensor:
    """Per-leaf chains of the last dim: ``[..., n] -> [..., leaves]`` (fp32)."""
    _check_fp32(x)
    n = check_divisible("reduced dimension", x.shape[-1], check_leaves(leaves))
    return halving_sum(x.reshape(*x.shape[:-1], leaves, n))


def leaf_tree_sum(x: torch.Tensor, leaves: int) -> torch.Tensor:
    """The contract's full reduction of the last dim: leaf chains, then the leaf tree.  With one
    leaf the chain is the whole reduction (the tree of one partial is that partial), so it is
    :func:`halving_sum` of ``x`` itself: the same adds, without the leaf axis's reshapes (host
    time of the token sums an eager backward makes many times a step)."""
    if leaves == 1:
        _check_fp32(x)
        return halving_sum(x)
    return tree_combine(leaf_partials(x, leaves))
