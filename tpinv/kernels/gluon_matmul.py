"""The contract matmul on Hopper (sm_90): input checks, launch plans and launches of the Gluon
kernel (:mod:`tpinv.kernels.gluon_matmul_kernel`).

Invariant kept: the same bits as :func:`tpinv.kernels.matmul_route.matmul_cuda` /
``matmul_partial_cuda``.  A plan picks the tile, the stages, the operands' TMA boxes and the
epilogue (a TMA store for a 16-bit output with 16-byte aligned rows, else stores from
registers) -- none of which changes an addition or the single rounding.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tpinv.kernels.gluon_matmul_kernel import SUPPORTED_LEAVES, _contract_mm_ws_kernel
from tpinv.kernels.descriptors import reused_descriptor
from tpinv.kernels.device import gluon_device_reason, sm_count
from tpinv.kernels.launch import cdiv, is_bound, launch_with, operands_key, remember
from tpinv.kernels.tiles import (GluonConfig, block_k, check_gluon_config, gluon_launch_config,
                                 gluon_staging_bytes)

__all__ = ["SUPPORTED_LEAVES", "unsupported_reason", "supported", "gluon_matmul_cuda", "plan_for",
           "uses_tma_store", "table_config", "launch_plan", "LaunchPlan"]

_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


class LaunchPlan(NamedTuple):
    """Everything about a launch that is fixed by the operands' shapes, strides, dtypes and
    alignment, the leaves, the output dtype and the config (:func:`plan_for`); TMA boxes are
    ``(block, shared layout)``.  The descriptor tables are filled per address once the launch is
    bound (:func:`~tpinv.kernels.descriptors.reused_descriptor`)."""
    x_t: bool                      #: x given as its [K, M] transpose
    w_kn: bool                     #: w given as its [K, N] transpose
    x_block: tuple
    w_block: tuple
    w2_block: Optional[tuple]      #: the second accumulator's w box, or None
    out_block: Optional[tuple]     #: the TMA store's box, or None: the epilogue stores from registers
    out2_block: Optional[tuple]
    grid: tuple
    bk: int
    kw: dict                       #: the kernel's constexprs
    bound: dict
    x_descs: dict
    w_descs: dict
    w2_descs: dict
    out_descs: dict
    out2_descs: dict


def unsupported_reason(x, w, leaves: int, out_dtype) -> str | None:
    """Why this kernel cannot run (x, w, leaves, out_dtype), or None when it can."""
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return "x and w must be torch tensors"
    if not (x.is_cuda and w.is_cuda) or x.device != w.device:
        return f"x and w must be on one CUDA device, got {x.device} and {w.device}"
    device = gluon_device_reason(x.device)
    if device is not None:
        return device
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        return f"x and w must both be bf16 or fp16, got {x.dtype} and {w.dtype}"
    if out_dtype not in (None, x.dtype, torch.float32):
        return f"out_dtype must be None, {x.dtype} or torch.float32, got {out_dtype}"
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        return (f"expected 2-D x [M, K] and w [N, K] with the same K; got x {tuple(x.shape)}, "
                f"w {tuple(w.shape)}")
    if not isinstance(leaves, int) or leaves not in SUPPORTED_LEAVES:
        return f"leaves must be one of {SUPPORTED_LEAVES}, got {leaves!r}"
    m, k = x.shape
    if m == 0 or w.shape[0] == 0 or k == 0:
        return f"empty operands (M={m}, N={w.shape[0]}, K={k})"
    if k % leaves:
        return f"K={k} is not divisible by leaves={leaves}"
    leaf_len = k // leaves
    if leaf_len % block_k(x.dtype, leaf_len):
        return (f"leaf length K/leaves={leaf_len} is not a multiple of its k tile "
                f"{block_k(x.dtype, leaf_len)} (the Triton kernel zero-pads such leaves)")
    for name, t in (("x", x), ("w", w)):
        if _major(t) is None:
            return (f"{name} must be row-major or column-major (unit-stride rows or the transpose of such) "
                    f"with 16-byte aligned rows, got shape {tuple(t.shape)} strides {t.stride()}")
        if t.data_ptr() % 16:
            return f"{name} must be 16-byte aligned for TMA"
    return None


def _major(t: torch.Tensor) -> str | None:
    """"row" ([R, K] rows of unit stride, as a contiguous tensor or a column slice of one), "col"
    (the transpose of such a [K, R]) or None; the outer stride must be 16-byte aligned for a TMA
    descriptor (which carries the strides: a slice reads only its own columns)."""
    rows, cols = t.shape
    if t.stride(1) == 1 and t.stride(0) >= cols and (t.stride(0) * t.element_size()) % 16 == 0:
        return "row"
    if t.stride(0) == 1 and t.stride(1) >= rows and (t.stride(1) * t.element_size()) % 16 == 0:
        return "col"
    return None


def supported(x: torch.Tensor, w: torch.Tensor, leaves: int) -> bool:
    """True when :func:`gluon_matmul_cuda` can run ``x @ w.T`` with ``leaves`` leaves."""
    return unsupported_reason(x, w, leaves, None) is None


def gluon_matmul_cuda(x: torch.Tensor, w: torch.Tensor, leaves: int,
                      out_dtype: torch.dtype | None = None, *,
                      config: GluonConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` by the contract (bits of ``matmul_cuda`` / ``matmul_partial_cuda``).

    x [M, K] and w [N, K] bf16/fp16 on an sm_90 GPU, each row-major or the transpose of a
    row-major tensor (the gradients' layouts); ``out_dtype`` None rounds
    once to ``x.dtype``, ``torch.float32`` returns the unrounded tree.  Raises ValueError
    naming what is unsupported (see :func:`supported`).
    """
    why = unsupported_reason(x, w, leaves, out_dtype)
    if why is not None:
        raise ValueError(f"gluon_matmul_cuda: {why}")
    out_dtype = out_dtype or x.dtype
    return launch_plan(x, w, leaves, out_dtype, plan_for(x, w, leaves, out_dtype, config))


def plan_for(x: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype,
             config: GluonConfig | None = None, *, operands: tuple | None = None) -> LaunchPlan:
    """The launch plan of inputs :func:`unsupported_reason` has passed, made once per shape,
    strides, dtypes, alignment, leaves and config (:func:`launch_plan` runs it).  The dispatch
    in :mod:`tpinv.kernels.matmul_route` keeps it per call shape: a repeated shape looks up
    one plan."""
    cfg = config or table_config(x, w, leaves)
    key = (operands or operands_key(x, w), leaves, out_dtype, cfg)
    plan = _PLANS.get(key)
    if plan is None:
        plan = remember(_PLANS, key, _plan(x, w, leaves, out_dtype, cfg))
    return plan


def uses_tma_store(x: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype | None = None,
                   config: GluonConfig | None = None) -> bool:
    """Whether :func:`gluon_matmul_cuda` with these arguments stores its output through shared
    memory and TMA (a 16-bit output with 16-byte aligned rows) rather than from registers."""
    return plan_for(x, w, leaves, out_dtype or x.dtype, config).out_block is not None


def table_config(x: torch.Tensor, w: torch.Tensor, leaves: int) -> GluonConfig:
    """The tile table's launch shape for ``x @ w.T`` on ``x``'s device (a speed choice only)."""
    return gluon_launch_config(x.shape[0], w.shape[0], leaves, sm_count(x.device))


def launch_plan(x: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype, plan: LaunchPlan) -> torch.Tensor:
    """Descriptors and launch for checked inputs and their plan (:func:`plan_for`): once the plan's
    launch is bound, descriptors are reused per address (:func:`~tpinv.kernels.descriptors.reused_descriptor`)."""
    m, k = x.shape
    n = w.shape[0]
    (x_t, w_kn, x_block, w_block, w2_block, out_block, out2_block, grid, bk, kw, bound, x_descs, w_descs,
     w2_descs, out_descs, out2_descs) = plan
    out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    reuse = is_bound(bound)
    x_desc = reused_descriptor(x_descs if reuse else None, x,
                               lambda: TensorDescriptor.from_tensor(x.t() if x_t else x, *x_block))
    w_desc = reused_descriptor(w_descs if reuse else None, w,
                               lambda: TensorDescriptor.from_tensor(w.t() if w_kn else w, *w_block))
    w2_desc = w_desc if w2_block is None else reused_descriptor(
        w2_descs if reuse else None, w, lambda: TensorDescriptor.from_tensor(w.t() if w_kn else w, *w2_block))
    out_desc = out2_desc = x_desc   # stand-ins where the epilogue stores from registers
    if out_block is not None:
        out_desc = reused_descriptor(out_descs if reuse else None, out,
                                     lambda: TensorDescriptor.from_tensor(out, *out_block))
        if out2_block is not None:
            out2_desc = reused_descriptor(out2_descs if reuse else None, out,
                                          lambda: TensorDescriptor.from_tensor(out, *out2_block))
    launch_with(_contract_mm_ws_kernel, grid,
                (x_desc, w_desc, w2_desc, out, out_desc, out2_desc, m, n, out.stride(0),
                 k // leaves // bk),
                kw, bound)
    return out


_PLANS: dict = {}


def _plan(x, w, leaves: int, out_dtype: torch.dtype, cfg: GluonConfig) -> LaunchPlan:
    """Tile layouts, persistent grid and constexprs of a launch: one per shape, strides, dtype,
    alignment, leaves, output dtype and config (none of it changes an addition)."""
    m, k = x.shape
    n = w.shape[0]
    leaf_len = k // leaves
    bk = block_k(x.dtype, leaf_len)
    check_gluon_config(cfg, leaves, bk)
    gdt = _DTYPES[x.dtype]
    x_t, w_kn = _major(x) == "col", _major(w) == "col"
    x_block = [bk, cfg.block_m] if x_t else [cfg.block_m, bk]
    w_block = [bk, cfg.block_n] if w_kn else [cfg.block_n, bk]
    w2_block = None
    if cfg.block_n2:
        w2_block = [bk, cfg.block_n2] if w_kn else [cfg.block_n2, bk]
        w2_block = (w2_block, _layout(w2_block, gdt))
    # the TMA store epilogue: a 16-bit output (the [m, n] tensor launch_plan allocates) whose rows
    # are 16-byte aligned
    out_block = out2_block = None
    epi_tma = out_dtype in _DTYPES and (n * 2) % 16 == 0
    if epi_tma:
        out_block = ([cfg.block_m, cfg.block_n], _layout([cfg.block_m, cfg.block_n], _DTYPES[out_dtype]))
        if cfg.block_n2:
            out2_block = ([cfg.block_m, cfg.block_n2], _layout([cfg.block_m, cfg.block_n2], _DTYPES[out_dtype]))
    # a config's stages are those that fit beside the staging tile; an epilogue from registers
    # gives the staging tile's own bytes back to the ring (the fp32 partials of the leaf-by-leaf route)
    stages = cfg.num_stages
    if not epi_tma:
        stages += gluon_staging_bytes(cfg, leaves) // ((cfg.block_m + cfg.tile_n) * bk * 2)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.tile_n)
    grid = (min(sm_count(x.device), tiles), )
    kw = dict(LEAVES=leaves, STAGES=stages, GROUP_M=cfg.group_m,
              PRODUCER_REGS=cfg.producer_regs, ZERO_ACC=cfg.zero_acc, X_T=x_t, W_KN=w_kn,
              BN2=cfg.block_n2, EPI_TMA=epi_tma, num_warps=cfg.num_warps)
    return LaunchPlan(x_t, w_kn, (x_block, _layout(x_block, gdt)), (w_block, _layout(w_block, gdt)), w2_block,
                      out_block, out2_block, grid, bk, kw, {}, {}, {}, {}, {}, {})


_LAYOUTS: dict = {}


def _layout(block: list[int], gdt):
    """The shared-memory layout of a TMA tile of ``block`` (swizzled for wgmma)."""
    key = (tuple(block), gdt)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(block, gdt)
    return _LAYOUTS[key]
