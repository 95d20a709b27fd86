"""The contiguous-halving sum on CUDA in one launch: the adds of :func:`reference_tree.halving_sum`.

Invariant kept: row ``r`` of the result is, bit for bit, the reference's halving sum of row
``r`` -- the row zero-padded to ``p = next_pow2(n)``, then ``v[:h] + v[h:]`` until one element is
left -- because the kernel performs exactly those fp32 adds, each an exact IEEE add, in the
same pairing: level 1 reads the two halves of the input (zero past ``n``) into a scratch of
``p/2`` partials per row, and each further level adds partial ``i + h`` into partial ``i`` (a
barrier between levels; one program owns its rows' partials for all levels).  The reference
issues ``log2(p)`` tensor adds (one launch each); this is one launch.  Neither the block of
rows a program takes nor the chunk of partials it adds at once changes an addition.  Inputs of a
16-bit dtype are widened to fp32 as they are read (exact), and the result may be stored rounded
to another dtype: the one rounding ``.to(dtype)`` of the fp32 sum would make, without its launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpinv.core.dtypes import MODEL_DTYPES
from tpinv.kernels.launch import cdiv, launch

__all__ = ["halving_sum_cuda", "ROWS", "CHUNK"]

#: Rows per program and partials per step (a speed choice: no addition depends on them).
ROWS, CHUNK = 16, 128


@triton.jit
def _halving_sum_kernel(x_ptr, s_ptr, out_ptr, R, n, half, log2_half, stride_xr, stride_xn,
                        ROWS: tl.constexpr, CHUNK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < R
    cols = tl.arange(0, CHUNK)
    # level 1: s[i] = x[i] + x[i + half] (zero past n); partials laid out [half, R]
    for i0 in range(0, half, CHUNK):
        i = i0 + cols
        ok = row_ok[:, None] & (i < half)[None, :]
        a = tl.load(x_ptr + rows[:, None] * stride_xr + i[None, :] * stride_xn,
                    mask=ok & (i < n)[None, :], other=0.0).to(tl.float32)
        b = tl.load(x_ptr + rows[:, None] * stride_xr + (i + half)[None, :] * stride_xn,
                    mask=ok & ((i + half) < n)[None, :], other=0.0).to(tl.float32)
        tl.store(s_ptr + i[None, :] * R + rows[:, None], a + b, mask=ok)
    # levels 2..: s[i] += s[i + h] for i < h
    for level in range(1, log2_half + 1):
        tl.debug_barrier()
        h = half >> level
        for i0 in range(0, h, CHUNK):
            i = i0 + cols
            ok = row_ok[:, None] & (i < h)[None, :]
            a = tl.load(s_ptr + i[None, :] * R + rows[:, None], mask=ok, other=0.0)
            b = tl.load(s_ptr + (i + h)[None, :] * R + rows[:, None], mask=ok, other=0.0)
            tl.store(s_ptr + i[None, :] * R + rows[:, None], a + b, mask=ok)
    tl.debug_barrier()
    total = tl.load(s_ptr + rows, mask=row_ok)
    tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)


def halving_sum_cuda(x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``reference_tree.halving_sum`` of a 2-D CUDA tensor ``[R, n]`` (any strides) widened to fp32:
    ``[R]``, the fp32 sums rounded once to ``out_dtype`` (``halving_sum(x.float()).to(out_dtype)``,
    bit for bit, in one launch)."""
    if x.dim() != 2 or x.dtype not in MODEL_DTYPES or out_dtype not in MODEL_DTYPES:
        raise ValueError(f"halving_sum_cuda takes a 2-D tensor of {MODEL_DTYPES} and an out_dtype among "
                         f"them, got {x.dim()}-D {x.dtype} and {out_dtype}")
    R, n = x.shape
    if n <= 1 or R == 0:
        first = x[:, 0].to(torch.float32) if n == 1 else x.new_zeros(R, dtype=torch.float32)
        return first.to(out_dtype, copy=True)
    half = 1 << ((n - 1).bit_length() - 1)       # p / 2 with p = next_pow2(n)
    scratch = torch.empty((half, R), dtype=torch.float32, device=x.device)
    out = torch.empty((R,), dtype=out_dtype, device=x.device)
    launch(_halving_sum_kernel, (cdiv(R, ROWS),), x, scratch, out, R, n, half,
           half.bit_length() - 1, x.stride(0), x.stride(1), ROWS=ROWS, CHUNK=CHUNK, num_warps=4, num_stages=1)
    return out
