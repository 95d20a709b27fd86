"""The contract matmul on CUDA: which kernel runs a product.  Every route gives the same bits.

Invariant kept: ``matmul_cuda`` / ``matmul_partial_cuda`` are the contract of
:mod:`tpinv.kernels.triton_matmul` (output element (m, n) a function of row m of ``x``, row n of
``w``, the dtype and ``leaves`` only), whichever kernel runs.  The route is a speed choice, kept
per call signature (:func:`~tpinv.kernels.launch.operands_key`, ``leaves``, output dtype):

* a ``config`` always runs the Triton kernel with it;
* products of :data:`~tpinv.kernels.tiles.GLUON_MIN_ROWS` or more bf16/fp16 rows on sm_90 run
  the warp-specialized Gluon kernel (:mod:`tpinv.kernels.gluon_matmul`), which keeps the same
  instruction sequence and so the same bits (:func:`gluon_kernel_for`);
* leaves of :data:`LEAF_SPLIT_MIN_LEN` or more that the Gluon kernel can read (the vocabulary
  reduction of a language-model head's dX: 8 leaves of 18992 at Qwen3's 151936) run one Gluon
  launch per leaf, each an fp32 one-leaf product of that leaf's K slice, and the tree's top as
  fp32 tensor adds (:class:`tpinv.core.contract.TreeAccumulator`): the split a tensor-parallel
  rank makes of its K slice, so the same bits, without the tree kernel's wait at every leaf end;
* everything else runs the Triton kernel with the table's launch config
  (:func:`~tpinv.kernels.tiles.launch_config`).

Inputs are checked once per call signature (every check is a function of the key), and on
every call with a launch config or a tensor subclass.
"""
from __future__ import annotations

import torch

from tpinv.core.contract import DEFAULT_LEAVES, TreeAccumulator
from tpinv.kernels.device import gluon_module
from tpinv.kernels.launch import operands_key, remember
from tpinv.kernels.tiles import GLUON_MIN_ROWS, MatmulConfig, check_config, launch_config
from tpinv.kernels.triton_matmul import (check_inputs, contract_plan, empty_product, launch_contract,
                                         launch_contract_plan, no_work)

__all__ = ["matmul_cuda", "matmul_partial_cuda", "gluon_kernel_for", "LEAF_SPLIT_MIN_LEN", "BY_LEAVES"]

_TENSORS = (torch.Tensor, torch.nn.Parameter)   # the types whose checks a route remembers (not subclasses)


def gluon_kernel_for(x2: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype):
    """The Gluon matmul module when it runs ``x2 @ w.T`` (a speed choice, never a bit
    choice), else None: fewer rows than :data:`GLUON_MIN_ROWS`, fp32, not sm_90, a layout
    it cannot read, or a Triton without Gluon."""
    if (x2.shape[0] < GLUON_MIN_ROWS or x2.dtype not in (torch.bfloat16, torch.float16)
            or not x2.is_cuda):
        return None
    gluon = gluon_module("gluon_matmul")   # imported on the first product that could use it
    return gluon if gluon is not None and gluon.unsupported_reason(x2, w, leaves, out_dtype) is None else None


_ROUTES: dict = {}   # (operands_key, leaves, out_dtype) -> (gluon module or None, its launch plan)


#: Leaf length from which a product of several leaves runs leaf by leaf (module docstring; a
#: speed choice: H100, docs/benchmarks.md 2026-11-26).
LEAF_SPLIT_MIN_LEN = 8192
#: The route of a product run leaf by leaf (:func:`_by_leaves`).
BY_LEAVES = "by leaves"


def _leaf(t: torch.Tensor, i: int, n: int) -> torch.Tensor:
    return t[:, i * n:(i + 1) * n]


def _by_leaves(x2: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``x2 @ w.T`` as ``leaves`` one-leaf fp32 products of the K slices and the tree's top."""
    n = x2.shape[1] // leaves
    tree = TreeAccumulator()
    for i in range(leaves):
        tree.push(_run(_leaf(x2, i, n), _leaf(w, i, n), 1, torch.float32, None))
    out = tree.result()
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def _route(x2: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype, operands: tuple) -> tuple:
    """Which kernel runs a call without a config, and its launch plan (one per call shape)."""
    n = x2.shape[1] // leaves
    if (leaves > 1 and n >= LEAF_SPLIT_MIN_LEN
            and gluon_kernel_for(_leaf(x2, 1, n), _leaf(w, 1, n), 1, torch.float32) is not None):
        return BY_LEAVES, None
    gluon = gluon_kernel_for(x2, w, leaves, out_dtype)
    if gluon is not None:
        return gluon, gluon.plan_for(x2, w, leaves, out_dtype, operands=operands)
    config = launch_config(x2.shape[0], leaves)
    return None, contract_plan(x2, w, leaves, out_dtype, config, True, operands)


def _run(x: torch.Tensor, w: torch.Tensor, leaves: int, out_dtype: torch.dtype,
         config: MatmulConfig | None) -> torch.Tensor:
    checked = config is not None or type(x) not in _TENSORS or type(w) not in _TENSORS or x.dim() < 1
    if checked:
        check_inputs(x, w, leaves)
    flat = x.dim() != 2
    x2 = x.reshape(-1, x.shape[-1]) if flat else x
    route = None
    if config is None:
        operands = operands_key(x2, w)   # one key per call: the kernel's choice and its launch plan
        key = (operands, leaves, out_dtype)
        route = _ROUTES.get(key)
        if route is None and not checked:   # every check is a function of the key: once per signature
            check_inputs(x, w, leaves)
    if config is not None:
        out = launch_contract(x2, w, leaves, out_dtype, check_config(config))
    elif route is None and no_work(x2, w):
        out = empty_product(x2, w, out_dtype)
    else:
        if route is None:
            route = remember(_ROUTES, key, _route(x2, w, leaves, out_dtype, operands))
        gluon, plan = route
        if gluon is BY_LEAVES:
            out = _by_leaves(x2, w, leaves, out_dtype)
        else:
            out = (gluon.launch_plan(x2, w, leaves, out_dtype, plan) if gluon is not None
                   else launch_contract_plan(x2, w, leaves, out_dtype, plan))
    return out.reshape(*x.shape[:-1], w.shape[0]) if flat else out


def matmul_partial_cuda(x: torch.Tensor, w: torch.Tensor, leaves: int = DEFAULT_LEAVES, *,
                        config: MatmulConfig | None = None) -> torch.Tensor:
    """fp32 ``x @ w.T`` by the contract: the leaf tree over ``leaves`` leaves, not rounded.

    x ``[..., K]`` (bf16/fp16/fp32, any strides), w ``[N, K]`` (nn.Linear layout, or a
    strided/transposed view of that shape), ``leaves`` a power of two dividing K.
    Returns fp32 ``[..., N]``.  A rank owning one of ``C`` contiguous K slices computes
    its sub-tree with ``leaves // C``; :func:`tpinv.core.contract.tree_combine` of the C
    partials equals this function at full K, bit for bit.  Without ``config`` a product
    of :data:`GLUON_MIN_ROWS` or more bf16/fp16 rows on sm_90 runs the Gluon kernel (same
    bits); a ``config`` (a :class:`~tpinv.kernels.tiles.MatmulConfig`) always runs the Triton
    kernel of :mod:`tpinv.kernels.triton_matmul`.
    """
    return _run(x, w, leaves, torch.float32, config)


def matmul_cuda(x: torch.Tensor, w: torch.Tensor, leaves: int = DEFAULT_LEAVES, *,
                config: MatmulConfig | None = None) -> torch.Tensor:
    """``x @ w.T`` by the contract, rounded once to ``x.dtype``.

    Same arguments and bits as :func:`matmul_partial_cuda`, cast in the epilogue.
    """
    return _run(x, w, leaves, x.dtype, config)
