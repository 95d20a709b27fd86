"""libdevice's flush-to-zero mode cannot move a bit of the Triton SiLU-and-mul kernels.

Triton 3.2 and 3.3 (torch 2.6, 2.7) always link libdevice in flush-to-zero mode; newer Tritons
have ``enable_reflect_ftz``, which :mod:`tpinv.kernels.triton_elementwise` turns off.  The
kernels' one libdevice call is ``exp(-g)``, used only as ``exp(-g) + 1``.  Checked here, on a
Triton that has the option: the forward and backward kernels compiled in both modes give the
same bits for every one of the 2**32 fp32 gate values.  Negative control: a libdevice call that
does read the mode, ``mul_rn(x, 1)`` of a subnormal ``x``, flushes it to zero under FTZ only, so
the switch is live in this Triton.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHUNK = 1 << 28


def _kernels():
    triton = pytest.importorskip("triton")
    from triton.backends.nvidia.compiler import CUDAOptions
    if "enable_reflect_ftz" not in CUDAOptions.__dataclass_fields__:
        pytest.skip(f"Triton {triton.__version__} has no enable_reflect_ftz (always flush-to-zero)")
    from tpinv.kernels import triton_elementwise
    return triton, triton_elementwise


def _all_fp32(start: int, n: int) -> torch.Tensor:
    bits = torch.arange(start, start + n, dtype=torch.int64, device="cuda") - (1 << 31)
    return bits.to(torch.int32).view(torch.float32)


def _silu(te, triton, g, ftz: bool):
    n, block = g.numel(), 1024
    ones = torch.ones_like(g)
    out, d_gate, d_up = (torch.empty_like(g) for _ in range(3))
    opts = dict(num_warps=4, enable_fp_fusion=False, enable_reflect_ftz=ftz)
    grid = (triton.cdiv(n, block),)
    te._silu_mul_fwd_kernel[grid](g, ones, out, n, BLOCK=block, PRECISE_EXP=True, **opts)
    te._silu_mul_bwd_kernel[grid](ones, g, ones, d_gate, d_up, n, BLOCK=block, PRECISE_EXP=True, **opts)
    return out, d_gate, d_up


def test_silu_bits_same_with_and_without_libdevice_ftz():
    triton, te = _kernels()
    for start in range(0, 1 << 32, CHUNK):
        g = _all_fp32(start, CHUNK)
        for a, b, what in zip(_silu(te, triton, g, False), _silu(te, triton, g, True), ("y", "d_gate", "d_up")):
            same = (a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))
            assert bool(same.all()), f"{what} differs for gate bits from {start - (1 << 31)}"


def test_control_libdevice_mul_differs_between_modes():
    triton, te = _kernels()
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def mul_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        tl.store(y_ptr + offs, libdevice.mul_rn(x, x * 0 + 1.0))

    x = torch.full((128,), 1e-39, device="cuda")   # subnormal fp32
    ys = []
    for ftz in (False, True):
        y = torch.empty_like(x)
        mul_kernel[(1,)](x, y, BLOCK=128, enable_reflect_ftz=ftz)
        ys.append(y)
    assert bool((ys[0] > 0).all()) and bool((ys[1] == 0).all()), (ys[0][0].item(), ys[1][0].item())
