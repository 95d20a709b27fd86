"""Fixed-order CPU matmul partials: the contract's K reduction from exact elementwise ops.

``matmul_partial(x, w, leaves)[..., n]`` is, bit for bit,
``leaf_tree_sum(x.float()[..., None, :] * w.float()[None, :, :], leaves)[..., n]``:
each product ``x[m, k] * w[n, k]`` is formed in fp32 (exact for bf16/fp16 inputs),
each of the ``leaves`` contiguous K-leaves is zero-padded to a power of two and
reduced by contiguous halving (element ``i`` plus element ``i + h``), and the leaf
results are combined by the adjacent-pair tree.  Every step is one IEEE ``mul`` or
``add`` per element, so an output element's bits depend only on its own row of
``x``, its own row of ``w`` and ``leaves`` -- never on M, N, chunking, strides or the
number of threads.  No BLAS, FMA or library reduction is used.

Speed comes from the layout, not from a different order.  Outputs are computed in
chunks whose products fit in cache, the first halving level is fused with the
products (``x_lo*w_lo + x_hi*w_hi``), and buffers are reused in place:

* ``_k_outer`` (many rows of ``x``): products are laid out ``[k, leaf, m, n]`` so that
  every halving level is one add of two long contiguous blocks;
* ``_k_inner`` (few rows of ``x``): products are laid out ``[m, n, leaf, k]``, which
  reads ``w`` in place (no transposed copy of a large weight for a decode step).
"""
from __future__ import annotations

import torch

from tpinv.core.contract import SUPPORTED_DTYPES, check_divisible, check_leaves
from tpinv.kernels.reference_tree import leaf_tree_sum

#: Products per chunk and thread of the K-outer layout: about 1 MiB of buffers per core's L2.
K_OUTER_CHUNK_PER_THREAD = 1 << 18
#: Products per chunk of the K-inner layout (it streams ``w`` once; larger chunks amortise more).
K_INNER_CHUNK = 1 << 20
#: Below this many rows of ``x`` the K-inner layout wins (no transposed copy of ``w``).
K_OUTER_MIN_ROWS = 16
#: Fewest outputs per chunk row in the K-outer layout (the length of the multiply's inner run).
K_OUTER_MIN_COLS = 128


def check_matmul_inputs(x: torch.Tensor, w: torch.Tensor, leaves: int) -> tuple[int, int]:
    """Validate ``x [..., K]``, ``w [N, K]`` and ``leaves``; returns ``(N, K)``."""
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(f"x and w must be tensors, got {type(x).__name__} and {type(w).__name__}")
    if x.dtype not in SUPPORTED_DTYPES or w.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"x and w must have one of {names}; got x {x.dtype}, w {w.dtype}")
    if x.dtype != w.dtype:
        raise TypeError(f"w dtype {w.dtype} must equal x dtype {x.dtype} (cast one of them)")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D with shape [N, K], got shape {list(w.shape)}")
    if x.dim() < 1:
        raise ValueError("x must have shape [..., K] with at least one dimension, got a scalar")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has shape {list(x.shape)} but w has shape {list(w.shape)}: expected "
                         f"x [..., {k}] for w [N={n}, K={k}] (or w [N, {x.shape[-1]}] for this x)")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but w is on {w.device}; expected one device")
    check_leaves(leaves)
    check_divisible("K", k, leaves)
    return n, k


def matmul_partial_reference(x: torch.Tensor, w: torch.Tensor, leaves: int) -> torch.Tensor:
    """The definition, materialising all ``M*N*K`` products (small shapes only)."""
    check_matmul_inputs(x, w, leaves)
    return leaf_tree_sum(x.float()[..., None, :] * w.float()[None, :, :], leaves)


def matmul_partial(x: torch.Tensor, w: torch.Tensor, leaves: int, *,
                   chunk_elements: int | None = None) -> torch.Tensor:
    """fp32 ``[..., N]``: the contract's reduction over K of ``x[..., k] * w[n, k]``.

    ``chunk_elements`` bounds the products held at once (default: tuned per layout); it
    changes speed, never bits.
    """
    n, k = check_matmul_inputs(x, w, leaves)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(*lead, n, dtype=torch.float32, device=x.device)
    if chunk_elements is not None and chunk_elements < 1:
        raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
    if m < K_OUTER_MIN_ROWS:
        out = _k_inner(x2, w, leaves, chunk_elements or K_INNER_CHUNK)
    else:
        threads = min(max(torch.get_num_threads(), 1), 8)   # speed only: bits never depend on it
        out = _k_outer(x2, w, leaves, chunk_elements or K_OUTER_CHUNK_PER_THREAD * threads)
    return out.reshape(*lead, n)


class _Leaf:
    """Sizes of one leaf: length ``n``, fused-level width ``h`` and ``tail = n - h``.

    A leaf of ``n > 1`` is padded to ``p = 2**ceil(log2(n))``; the first halving level adds
    position ``i + h`` (``h = p/2``) onto ``i`` for ``i < tail`` and the zero pad for the rest.
    """

    def __init__(self, k: int, leaves: int) -> None:
        self.n = k // leaves
        self.h = 1 << (self.n - 1).bit_length() - 1 if self.n > 1 else 1
        self.tail = self.n - self.h if self.n > 1 else 0


def _k_outer(x: torch.Tensor, w: torch.Tensor, leaves: int, chunk: int) -> torch.Tensor:
    """Products ``[k, leaf, m, n]`` per chunk; each halving level is one contiguous add."""
    m, k = x.shape
    n = w.shape[0]
    leaf = _Leaf(k, leaves)
    per_out = max(1, chunk // k)
    nc = min(n, max(K_OUTER_MIN_COLS, per_out))
    mc = max(1, min(m, per_out // nc))
    gm, gn = -(-m // mc), -(-n // nc)
    # Zero-padded, transposed fp32 copies: x_t[i] is [leaf.n, leaves, mc], w_t[j] [leaf.n, leaves, nc].
    # Padding rows only make extra outputs, which are dropped.
    x_t = _blocked_transpose(x, gm, mc, leaves, leaf.n)
    w_t = _blocked_transpose(w, gn, nc, leaves, leaf.n)
    out = torch.empty(gm, gn, mc, nc, dtype=torch.float32)
    block = leaves * mc * nc
    prod = torch.empty(leaf.h * block, dtype=torch.float32)
    prod_tail = torch.empty(max(leaf.tail, 1) * block, dtype=torch.float32)
    prod4 = prod.view(leaf.h, leaves, mc, nc)
    tail4 = prod_tail[:leaf.tail * block].view(leaf.tail, leaves, mc, nc)
    head = prod[:leaf.tail * block]
    pad = prod[leaf.tail * block:] if 0 < leaf.tail < leaf.h else None
    levels = _halving_views(prod, leaf.h, block)
    tree, last = _tree_views(prod4[0], leaves)
    x_parts = [_split_leaf(x_t[i].unsqueeze(-1), leaf) for i in range(gm)]
    w_parts = [_split_leaf(w_t[j].unsqueeze(-2), leaf) for j in range(gn)]
    for j in range(gn):             # w chunk outer: it stays in cache across x chunks
        w_lo, w_hi = w_parts[j]
        for i in range(gm):
            x_lo, x_hi = x_parts[i]
            torch.mul(x_lo, w_lo, out=prod4)
            if leaf.tail:
                torch.mul(x_hi, w_hi, out=tail4)
                head.add_(prod_tail[:leaf.tail * block])
                if pad is not None:
                    pad.add_(0.0)   # the zero padding: x + 0.0, as the definition does
            for dst, src in levels:
                dst.add_(src)
            _finish_tree(tree, last, out[i, j])
    return out.permute(0, 2, 1, 3).reshape(gm * mc, gn * nc)[:m, :n]


def _k_inner(x: torch.Tensor, w: torch.Tensor, leaves: int, chunk: int) -> torch.Tensor:
    """Products ``[m, n, leaf, k]`` per chunk; reads the rows of ``w`` in place."""
    m, k = x.shape
    n = w.shape[0]
    leaf = _Leaf(k, leaves)
    x3 = x.float().contiguous().view(m, leaves, leaf.n)
    w_direct = w.dtype == torch.float32 and w.is_contiguous()
    per_out = max(1, chunk // k)
    mc = min(m, per_out)
    nc = min(n, max(1, per_out // mc))
    w_buf = None if w_direct else torch.empty(nc, k, dtype=torch.float32)
    prod = torch.empty(mc * nc * leaves * leaf.h, dtype=torch.float32)
    prod_tail = torch.empty(mc * nc * leaves * max(leaf.tail, 1), dtype=torch.float32)
    out = torch.empty(m, n, dtype=torch.float32)
    for n0 in range(0, n, nc):
        tn = min(nc, n - n0)
        if w_direct:
            w3 = w[n0:n0 + tn].view(1, tn, leaves, leaf.n)
        else:
            w3 = w_buf[:tn].copy_(w[n0:n0 + tn]).view(1, tn, leaves, leaf.n)
        for m0 in range(0, m, mc):
            tm = min(mc, m - m0)
            x4 = x3[m0:m0 + tm].unsqueeze(1)
            p = prod[:tm * tn * leaves * leaf.h].view(tm, tn, leaves, leaf.h)
            if leaf.tail:
                torch.mul(x4[..., :leaf.h], w3[..., :leaf.h], out=p)
                t = prod_tail[:tm * tn * leaves * leaf.tail].view(tm, tn, leaves, leaf.tail)
                torch.mul(x4[..., leaf.h:], w3[..., leaf.h:], out=t)
                p[..., :leaf.tail].add_(t)
                if leaf.tail < leaf.h:
                    p[..., leaf.tail:].add_(0.0)
            else:
                torch.mul(x4, w3, out=p)
            q = leaf.h
            while q > 1:
                q //= 2
                p[..., :q].add_(p[..., q:2 * q])
            tree, last = _tree_views(p[..., 0].movedim(-1, 0), leaves)
            _finish_tree(tree, last, out[m0:m0 + tm, n0:n0 + tn])
    return out


def _blocked_transpose(a: torch.Tensor, groups: int, rows: int, leaves: int, n: int) -> torch.Tensor:
    """``a [R, K]`` -> fp32 ``[groups, n, leaves, rows]`` with zero rows past ``R``."""
    padded = torch.zeros(groups * rows, leaves * n, dtype=torch.float32)
    padded[:a.shape[0]] = a
    return padded.view(groups, rows, leaves, n).permute(0, 3, 2, 1).contiguous()


def _split_leaf(a: torch.Tensor, leaf: _Leaf) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first ``h`` and the last ``tail`` positions of each leaf (dim 0 of ``a``)."""
    if not leaf.tail:
        return a, None
    return a[:leaf.h], a[leaf.h:]


def _halving_views(flat: torch.Tensor, length: int, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst, src)`` pairs that halve ``flat`` viewed as ``[length, block]`` down to row 0."""
    views = []
    while length > 1:
        length //= 2
        views.append((flat[:length * block], flat[length * block:2 * length * block]))
    return views


def _tree_views(parts: torch.Tensor, leaves: int):
    """In-place adjacent-pair tree over dim 0 of ``parts``: ``(levels, last pair)``."""
    levels = []
    step = 1
    while 2 * step < leaves:
        levels.append((parts[0::2 * step], parts[step::2 * step]))
        step *= 2
    last = (parts[0], parts[leaves // 2]) if leaves > 1 else (parts[0], None)
    return levels, last


def _finish_tree(levels, last, out: torch.Tensor) -> None:
    for dst, src in levels:
        dst.add_(src)
    if last[1] is None:
        out.copy_(last[0])
    else:
        torch.add(last[0], last[1], out=out)
