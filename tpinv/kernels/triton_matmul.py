"""The contract matmul on CUDA (Triton): ``x @ w.T`` with a fixed k order.

(Which kernel runs a product -- this one, the warp-specialized Gluon kernel of
:mod:`tpinv.kernels.gluon_matmul`, or that one leaf by leaf -- is chosen in
:mod:`tpinv.kernels.matmul_route`; every choice gives the same bits.)

Invariant kept: output element (m, n) is, bit for bit, a function of row m of ``x``,
row n of ``w``, the dtype and ``leaves`` only.  K is cut into ``leaves`` equal leaves;
each leaf is an fp32 chain ``acc = dot(a_tile, b_tile, acc)`` over BLOCK_K tiles in k
order, starting from zero at the leaf's first k (BLOCK_K from :mod:`tiles`: dtype and
leaf length only); the leaf results are combined in fp32 by the adjacent-pair tree
``((l0+l1)+(l2+l3))+...``; ``matmul_cuda`` rounds once, in the epilogue.

One CTA runs one pipelined loop over the k tiles of its leaves.  At each leaf end a
binary counter advances the tree: while the counter's low bits are 1 the waiting left
sibling is added (``left + v``) and the step goes up a level; at the first 0 bit the
value parks in that level's register tile.  So at most log2(leaves) partial tiles wait
beside the running one, and every add is the tree's own.  With ``split > 1`` several
CTAs each compute one aligned sub-tree and a second kernel adds the sub-trees with the
top of the same tree.  No launch choice (tile shape, warps, stages, split, load path)
changes an addition; see :mod:`tpinv.kernels.tiles`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tpinv.core.contract import InvarianceError, check_divisible, check_dtype, check_leaves
from tpinv.kernels.descriptors import TensorDescriptor, reused_descriptor
from tpinv.kernels.launch import cdiv, is_bound, launch, launch_with, operands_key, remember
from tpinv.kernels.tiles import MAX_LEAVES_PER_CTA, MatmulConfig, block_k

_INT32_MAX = 2**31 - 1


@triton.jit
def _load_tiles(x_ref, w_ref, offs_m, offs_n, off_m, off_n, k, k_in_leaf, leaf_len,
                stride_xm, stride_xk, stride_wn, stride_wk,
                USE_TMA: tl.constexpr, W_KN: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr):
    """The (a [BM, BK], b [BK, BN]) k tile at absolute k; zero past the leaf's end."""
    if USE_TMA:
        a = x_ref.load([off_m, k])
        if W_KN:
            b = w_ref.load([k, off_n])
        else:
            b = w_ref.load([off_n, k]).T
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ref + offs_m[:, None] * stride_xm + (k + offs_k)[None, :] * stride_xk
        b_ptrs = w_ref + offs_n[None, :] * stride_wn + (k + offs_k)[:, None] * stride_wk
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (k_in_leaf + offs_k) < leaf_len
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
    return a, b


@triton.jit
def _counter_step(v, saved, leaf, LEVEL: tl.constexpr):
    """Tree step at one level after leaf ``leaf`` (not the CTA's last) ended with v.

    The step reaches LEVEL when the leaf's lower bits are all 1; there, bit 1 means the
    left sibling waits in ``saved`` (v = saved + v, go up), bit 0 means v is a left
    child and parks in ``saved``.
    """
    low: tl.constexpr = (1 << LEVEL) - 1
    reached = (leaf & low) == low
    bit = ((leaf >> LEVEL) & 1) == 1
    v_up = tl.where(reached & bit, saved + v, v)
    saved = tl.where(reached & (not bit), v, saved)
    return v_up, saved


@triton.jit(do_not_specialize=["M", "N"])
def _contract_mm_kernel(x_ref, w_ref, out_ptr, M, N, leaf_len,
                        stride_xm, stride_xk, stride_wn, stride_wk,
                        stride_og, stride_om, stride_on,
                        LEAVES_PER_CTA: tl.constexpr, LOG2_LEAVES_PER_CTA: tl.constexpr,
                        USE_TMA: tl.constexpr, W_KN: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IS_FP32: tl.constexpr):
    """Grid (output tiles, split).  CTA (t, g) writes the sub-tree of leaves
    [g*LEAVES_PER_CTA, (g+1)*LEAVES_PER_CTA) of tile t to out[g], cast to out's dtype."""
    pid = tl.program_id(0)
    group = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = (off_m + tl.arange(0, BLOCK_M)) % M  # rows past M re-read real rows, never stored
    offs_n = (off_n + tl.arange(0, BLOCK_N)) % N

    tiles_per_leaf = tl.cdiv(leaf_len, BLOCK_K)
    k_first = group * LEAVES_PER_CTA * leaf_len
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(0, LEAVES_PER_CTA * tiles_per_leaf):
        leaf = it // tiles_per_leaf
        j = it - leaf * tiles_per_leaf
        a, b = _load_tiles(x_ref, w_ref, offs_m, offs_n, off_m, off_n,
                           k_first + leaf * leaf_len + j * BLOCK_K, j * BLOCK_K, leaf_len,
                           stride_xm, stride_xk, stride_wn, stride_wk,
                           USE_TMA, W_KN, BLOCK_K, EVEN_K)
        if IS_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if LOG2_LEAVES_PER_CTA >= 1:
            if (j == tiles_per_leaf - 1) & (leaf < LEAVES_PER_CTA - 1):
                v = acc
                v, s0 = _counter_step(v, s0, leaf, 0)
                if LOG2_LEAVES_PER_CTA >= 2:
                    v, s1 = _counter_step(v, s1, leaf, 1)
                if LOG2_LEAVES_PER_CTA >= 3:
                    v, s2 = _counter_step(v, s2, leaf, 2)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    # the last leaf: every counter bit is 1, so it climbs the whole tree
    result = acc
    if LOG2_LEAVES_PER_CTA >= 1:
        result = s0 + result
    if LOG2_LEAVES_PER_CTA >= 2:
        result = s1 + result
    if LOG2_LEAVES_PER_CTA >= 3:
        result = s2 + result
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    out_ptrs = (out_ptr + group.to(tl.int64) * stride_og
                + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_groups_kernel(ws_ptr, out_ptr, numel, stride_g,
                           GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    """out = adjacent-pair tree over the GROUPS fp32 sub-tree partials, rounded once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    r = tl.load(ws_ptr + offs, mask=mask) + tl.load(ws_ptr + stride_g + offs, mask=mask)
    if GROUPS >= 4:
        r = r + (tl.load(ws_ptr + 2 * stride_g + offs, mask=mask)
                 + tl.load(ws_ptr + 3 * stride_g + offs, mask=mask))
    if GROUPS == 8:
        r = r + ((tl.load(ws_ptr + 4 * stride_g + offs, mask=mask)
                  + tl.load(ws_ptr + 5 * stride_g + offs, mask=mask))
                 + (tl.load(ws_ptr + 6 * stride_g + offs, mask=mask)
                    + tl.load(ws_ptr + 7 * stride_g + offs, mask=mask)))
    tl.store(out_ptr + offs, r.to(out_ptr.dtype.element_ty), mask=mask)


def check_inputs(x: torch.Tensor, w: torch.Tensor, leaves: int) -> None:
    """Raise for inputs the kernel does not take.  Every check is a function of the operands'
    shapes, dtypes and devices and of ``leaves``, which a kept route's key holds: the route
    (:mod:`tpinv.kernels.matmul_route`) checks a call signature on its first call (and every call
    with a launch config or a tensor subclass), not again once its route is kept."""
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError("x and w must be torch tensors")
    if not (x.is_cuda and w.is_cuda):
        raise ValueError(f"matmul_cuda needs CUDA tensors, got x on {x.device}, w on {w.device}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but w is on {w.device}")
    check_dtype(x.dtype, "x")
    if w.dtype != x.dtype:
        raise TypeError(f"w dtype {w.dtype} must equal x dtype {x.dtype}")
    if x.dim() < 1 or w.dim() != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"expected x [..., K] and w [N, K] (nn.Linear layout) with the same K; "
                         f"got x {tuple(x.shape)}, w {tuple(w.shape)}")
    check_leaves(leaves)
    check_divisible("K", x.shape[-1], leaves)
    if leaves > MAX_LEAVES_PER_CTA * 8:
        raise InvarianceError(f"leaves={leaves} is above the supported {MAX_LEAVES_PER_CTA * 8}")


def _tma_ok(t: torch.Tensor, inner: int) -> bool:
    """A 2-D tensor a descriptor can read: dim ``inner`` unit-stride, the other 16-B aligned."""
    item = t.element_size()
    outer = 1 - inner
    return (TensorDescriptor is not None and t.stride(inner) == 1
            and (t.stride(outer) * item) % 16 == 0 and t.data_ptr() % 16 == 0
            and t.shape[outer] * t.stride(outer) < _INT32_MAX)


class ContractPlan(NamedTuple):
    """Everything about a launch that follows from shapes, strides, dtypes and alignment."""
    use_tma: bool
    w_kn: bool
    x_block: list
    w_block: list
    split: int
    grid: tuple
    consts: dict
    bound: dict           # device -> bound launcher of the contract kernel (tpinv.kernels.launch)
    bound_combine: dict   # the same for the split combine kernel
    x_descs: dict         # address -> TMA descriptor of x, once bound (tpinv.kernels.descriptors.reused_descriptor)
    w_descs: dict         # the same for w


_PLANS: dict = {}


def contract_plan(x2: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype,
                  config: MatmulConfig, allow_tma: bool, operands: tuple | None) -> ContractPlan:
    """The launch plan of the contract kernel for these operands and ``config`` (one per call shape)."""
    key = (operands or operands_key(x2, w), leaves, out_dtype, config, allow_tma)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    m, k = x2.shape
    n = w.shape[0]
    leaf_len = k // leaves
    bk = block_k(x2.dtype, leaf_len)
    split = config.effective_split(leaves)
    per_cta = leaves // split
    bm, bn = config.block_m, config.block_n
    even_k = leaf_len % bk == 0
    w_kn = w.stride(0) == 1 and w.stride(1) != 1
    use_tma = (allow_tma and even_k and _tma_ok(x2, 1)
               and (_tma_ok(w, 0) if w_kn else _tma_ok(w, 1)))
    if not use_tma:
        w_kn = False
        for name, t in (("x", x2), ("w", w)):
            if sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) > _INT32_MAX:
                raise ValueError(f"{name} {tuple(t.shape)} is too large for 32-bit offsets; "
                                 f"split it along its rows")
    consts = dict(LEAVES_PER_CTA=per_cta, LOG2_LEAVES_PER_CTA=per_cta.bit_length() - 1,
                  USE_TMA=use_tma, W_KN=w_kn, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  GROUP_M=config.group_m, EVEN_K=even_k, IS_FP32=(x2.dtype == torch.float32),
                  num_warps=config.num_warps, num_stages=config.num_stages)
    grid = (cdiv(m, bm) * cdiv(n, bn), split)
    return remember(_PLANS, key, ContractPlan(use_tma, w_kn, [bm, bk], [bk, bn] if w_kn else [bn, bk], split,
                                              grid, consts, {}, {}, {}, {}))


def launch_contract(x2: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype,
                    config: MatmulConfig, allow_tma: bool = True) -> torch.Tensor:
    """Run the kernel on x2 [M, K], w [N, K] with ``config``; ``allow_tma=False`` forces pointer loads."""
    if no_work(x2, w):
        return empty_product(x2, w, out_dtype)
    plan = contract_plan(x2, w, leaves, out_dtype, config, allow_tma, None)
    return launch_contract_plan(x2, w, leaves, out_dtype, plan)


def no_work(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the product has no rows, no columns or K = 0 (nothing to launch)."""
    return x2.shape[0] == 0 or w.shape[0] == 0 or x2.shape[1] == 0


def empty_product(x2: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The product of operands with no rows, no columns or K = 0 (zeros)."""
    return torch.zeros((x2.shape[0], w.shape[0]), device=x2.device, dtype=out_dtype)


def launch_contract_plan(x2: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype,
                         plan: ContractPlan) -> torch.Tensor:
    """Descriptors and launch of non-empty operands and their plan (:func:`contract_plan`)."""
    m, k = x2.shape
    n = w.shape[0]
    out = torch.empty((m, n), device=x2.device, dtype=out_dtype)
    if plan.use_tma:
        reuse = is_bound(plan.bound)
        x_ref = reused_descriptor(plan.x_descs if reuse else None, x2,
                                  lambda: TensorDescriptor(x2, [m, k], [x2.stride(0), 1], plan.x_block))
        w_ref = reused_descriptor(plan.w_descs if reuse else None, w,
                                  lambda: (TensorDescriptor(w.T, [k, n], [w.stride(1), 1], plan.w_block) if plan.w_kn
                                           else TensorDescriptor(w, [n, k], [w.stride(0), 1], plan.w_block)))
    else:
        x_ref, w_ref = x2, w
    split = plan.split
    if split == 1:
        dest, stride_g = out, 0
    else:
        dest = torch.empty((split, m, n), device=x2.device, dtype=torch.float32)
        stride_g = dest.stride(0)
    launch_with(_contract_mm_kernel, plan.grid,
                (x_ref, w_ref, dest, m, n, k // leaves, x2.stride(0), x2.stride(1), w.stride(0), w.stride(1),
                 stride_g, dest.stride(-2), dest.stride(-1)), plan.consts, plan.bound)
    if split > 1:
        block = 1024
        launch(_combine_groups_kernel, (cdiv(m * n, block),),
               dest, out, m * n, stride_g, bound=plan.bound_combine, GROUPS=split, BLOCK=block,
               num_warps=4)
    return out
