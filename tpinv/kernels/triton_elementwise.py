"""SiLU-and-multiply and rotary embedding on CUDA (Triton): one instruction sequence per element.

Invariant kept: every output element is a function of its own inputs only (its ``gate``/``up``
pair; its ``x`` half-dim pair and that position's ``cos``/``sin`` entries), computed in fp32 by
the same fixed sequence of separately rounded operations wherever it sits in the launch, and
rounded once to the output dtype.  There is no reduction, so neither the tile shape, the grid,
the batch size nor padding can change a bit; the block sizes below are speed choices only.

The sequences are those of :mod:`tpinv.kernels.reference_activation` and
:mod:`tpinv.kernels.reference_rope`:

- ``silu_mul``: ``e = exp(-g); d = e + 1; y = (g / d) * u``; backward
  ``sig = 1 / d; d_gate = (grad * u) * (sig * ((g * (1 - sig)) + 1)); d_up = grad * (g / d)``.
- rope: ``out = x*cos + rotate_half(x)*sin``, backward ``grad*cos - rotate_half(grad)*sin``,
  ``rotate_half(x) = cat(-x2, x1)``; one program rotates both halves of its rows, so ``x`` is
  read once, and holds one ``cos``/``sin`` tile for a group of heads of the same positions.

Divisions are correctly rounded (``div_rn``, as torch's ``/``), products and sums are never
contracted into fused multiply-adds (``enable_fp_fusion=False``), and ``exp`` is libdevice's
``expf`` without flush-to-zero: the same operations torch's own CUDA kernels run for the
CPU-path code.  Under ``TRITON_INTERPRET=1`` (CPU tensors) ``exp`` is numpy's.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tpinv.kernels.launch import cdiv, launch, next_power_of_2
from tpinv.kernels.layout import empty_in_layout_of
from tpinv.core.contract import InvarianceError
from tpinv.kernels.reference_activation import check_silu_mul_inputs
from tpinv.kernels.reference_rope import check_rope_inputs

try:  # the libdevice entry points (absent from the interpreter's view of triton)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - every triton >= 3.0 ships it
    libdevice = None

__all__ = ["silu_mul_forward_cuda", "silu_mul_backward_cuda", "apply_rope_forward_cuda",
           "apply_rope_backward_cuda", "silu_config", "rope_config"]


def _exact_options() -> dict:
    """Launch options of every kernel here: no mul+add contraction, IEEE subnormals in libdevice.

    ``enable_reflect_ftz`` is absent from Triton 3.2 and 3.3 (torch 2.6, 2.7), which always link
    libdevice in flush-to-zero mode and reject the option.  The one libdevice call
    here, ``exp``, gives the same bits in both modes: the forward and backward kernels compiled
    with and without FTZ agree on all 2**32 fp32 gate values (tests/gpu/test_libdevice_ftz.py).
    """
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        has_ftz_option = "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        has_ftz_option = False
    return dict(enable_fp_fusion=False, **({"enable_reflect_ftz": False} if has_ftz_option else {}))


#: Launch options of the elementwise kernels (here and :mod:`tpinv.kernels.triton_cross_entropy`).
EXACT_OPTIONS = _exact_options()


def interpreting() -> bool:
    """True under Triton's interpreter (CPU tensors, numpy's ``exp``: no libdevice)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def exp_f32(x, PRECISE_EXP: tl.constexpr):
    """fp32 ``exp``: libdevice's (``PRECISE_EXP``; IEEE subnormals under :data:`EXACT_OPTIONS`) or
    Triton's approximate one (the interpreter, and the GPU tests' negative controls)."""
    if PRECISE_EXP:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


# ------------------------------------------------------------------ silu_mul

@triton.jit
def _silu_mul_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr, PRECISE_EXP: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    denom = exp_f32(-g, PRECISE_EXP) + 1.0
    y = tl.math.div_rn(g, denom) * u
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_bwd_kernel(grad_ptr, gate_ptr, up_ptr, d_gate_ptr, d_up_ptr, n, BLOCK: tl.constexpr,
                         PRECISE_EXP: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dy = tl.load(grad_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    denom = exp_f32(-g, PRECISE_EXP) + 1.0
    sig = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), denom)
    dsilu = sig * ((g * (1.0 - sig)) + 1.0)
    d_gate = (dy * u) * dsilu
    d_up = dy * tl.math.div_rn(g, denom)
    tl.store(d_gate_ptr + offs, d_gate.to(d_gate_ptr.dtype.element_ty), mask=ok)
    tl.store(d_up_ptr + offs, d_up.to(d_up_ptr.dtype.element_ty), mask=ok)


def silu_config(numel: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for ``numel`` elements (a speed choice: no element depends on it)."""
    return (4096, 8) if numel >= (1 << 20) else (1024, 4)


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"expected all tensors on one device, got {sorted(map(str, devices))}")
    if not tensors[0].is_cuda and not interpreting():
        raise ValueError(f"the Triton elementwise kernels need CUDA tensors, got {tensors[0].device} "
                         "(use tpinv.kernels.reference_activation / reference_rope on CPU)")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def _launch_silu_fwd(gate, up, config=None):
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    if n:
        block, warps = config or silu_config(n)
        launch(_silu_mul_fwd_kernel, (cdiv(n, block),),
            _flat(gate), _flat(up), out.view(-1), n, BLOCK=block, PRECISE_EXP=not interpreting(),
            num_warps=warps, **EXACT_OPTIONS)
    return out


def _launch_silu_bwd(grad, gate, up, config=None):
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = gate.numel()
    if n:
        block, warps = config or silu_config(n)
        launch(_silu_mul_bwd_kernel, (cdiv(n, block),),
            _flat(grad), _flat(gate), _flat(up), d_gate.view(-1), d_up.view(-1), n, BLOCK=block,
            PRECISE_EXP=not interpreting(), num_warps=warps, **EXACT_OPTIONS)
    return d_gate, d_up


def silu_mul_forward_cuda(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, rounded once to the input dtype (contiguous output)."""
    check_silu_mul_inputs(gate, up)
    _check_device(gate, up)
    return _launch_silu_fwd(gate, up)


def silu_mul_backward_cuda(grad: torch.Tensor, gate: torch.Tensor,
                           up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_gate, d_up)`` of :func:`silu_mul_forward_cuda`, in the input dtype."""
    check_silu_mul_inputs(gate, up)
    if not isinstance(grad, torch.Tensor) or grad.shape != gate.shape:
        raise InvarianceError(f"silu_mul grad must be a tensor of shape {tuple(gate.shape)}, got "
                              f"{tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__}")
    if not grad.dtype.is_floating_point:
        raise TypeError(f"silu_mul grad must be a floating tensor, got {grad.dtype}")
    _check_device(grad, gate, up)
    return _launch_silu_bwd(grad, gate, up)


# ------------------------------------------------------------------ rope

@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, S,
                 sx_b, sx_h, sx_s, sc_b, sc_s, ss_b, ss_s, so_b, so_h, so_s,
                 n_hgroups, n_dchunks, n_sblocks,
                 HALF: tl.constexpr, SIGN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    # program -> (b, s block, d chunk, head group), head group fastest: programs that run side
    # by side share one cos/sin tile
    pid = tl.program_id(0).to(tl.int64)
    hg = pid % n_hgroups
    rest = pid // n_hgroups
    dc = rest % n_dchunks
    rest = rest // n_dchunks
    sb = rest % n_sblocks
    b = rest // n_sblocks
    h = hg * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    d = dc * BLOCK_HALF + tl.arange(0, BLOCK_HALF)
    h3 = h[:, None, None]
    s3 = s[None, :, None]
    d3 = d[None, None, :]
    ok_t = (s3 < S) & (d3 < HALF)
    ok = (h3 < H) & ok_t
    c_off = b * sc_b + s3 * sc_s + d3
    s_off = b * ss_b + s3 * ss_s + d3
    c1 = tl.load(cos_ptr + c_off, mask=ok_t, other=0.0)
    c2 = tl.load(cos_ptr + c_off + HALF, mask=ok_t, other=0.0)
    s1 = tl.load(sin_ptr + s_off, mask=ok_t, other=0.0)
    s2 = tl.load(sin_ptr + s_off + HALF, mask=ok_t, other=0.0)
    x_off = b * sx_b + h3 * sx_h + s3 * sx_s + d3
    x1 = tl.load(x_ptr + x_off, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_off + HALF, mask=ok, other=0.0).to(tl.float32)
    if SIGN > 0:   # forward: x*cos + cat(-x2, x1)*sin
        y1 = x1 * c1 + (-x2) * s1
        y2 = x2 * c2 + x1 * s2
    else:          # backward: g*cos - cat(-g2, g1)*sin
        y1 = x1 * c1 - (-x2) * s1
        y2 = x2 * c2 - x1 * s2
    o_off = b * so_b + h3 * so_h + s3 * so_s + d3
    tl.store(out_ptr + o_off, y1.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + o_off + HALF, y2.to(out_ptr.dtype.element_ty), mask=ok)


def rope_config(heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """``(BLOCK_H, BLOCK_S, BLOCK_HALF, num_warps)`` for ``heads`` x ``head_dim`` (speed only).

    A program rotates ``BLOCK_H`` heads x ``BLOCK_S`` positions x ``2 * BLOCK_HALF`` lanes
    (4096 elements for head_dim >= 8), all heads of the group sharing one cos/sin tile.
    """
    block_half = min(next_power_of_2(max(head_dim // 2, 1)), 1024)
    rows = max(2048 // block_half, 1)
    block_h = min(next_power_of_2(heads), 4, rows)
    block_s = max(rows // block_h, 1)
    return block_h, block_s, block_half, 4


def _table(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A table with unit last stride and its ``(batch, position)`` strides (batch 0 when 2-D)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:
        return t, 0, t.stride(0)
    return t, t.stride(0), t.stride(1)


def _launch_rope(x, cos, sin, sign, config=None):
    batch, heads, seq, dim = x.shape
    out = empty_in_layout_of(x)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sc_b, sc_s = _table(cos)
    sin, ss_b, ss_s = _table(sin)
    block_h, block_s, block_half, warps = config or rope_config(heads, dim)
    half = dim // 2
    n_hgroups, n_dchunks = cdiv(heads, block_h), cdiv(half, block_half)
    n_sblocks = cdiv(seq, block_s)
    grid = (batch * n_sblocks * n_dchunks * n_hgroups,)
    launch(_rope_kernel, grid, x, cos, sin, out, heads, seq,
                       x.stride(0), x.stride(1), x.stride(2), sc_b, sc_s, ss_b, ss_s,
                       out.stride(0), out.stride(1), out.stride(2), n_hgroups, n_dchunks, n_sblocks,
                       HALF=half, SIGN=sign, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_HALF=block_half,
                       num_warps=warps, **EXACT_OPTIONS)
    return out


def apply_rope_forward_cuda(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x*cos + rotate_half(x)*sin`` in fp32, rounded once to ``x.dtype`` (``[B, H, S, D]``)."""
    check_rope_inputs(x, cos, sin)
    _check_device(x, cos, sin)
    return _launch_rope(x, cos, sin, 1)


def apply_rope_backward_cuda(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``grad*cos - rotate_half(grad)*sin`` in fp32, rounded once to ``grad.dtype``."""
    check_rope_inputs(grad, cos, sin)
    _check_device(grad, cos, sin)
    return _launch_rope(grad, cos, sin, -1)
