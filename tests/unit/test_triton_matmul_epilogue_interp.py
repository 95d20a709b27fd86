"""The Triton contract matmul's epilogue rounding under Triton's interpreter (CPU tensors), bitwise.

Checked: the kernel storing fp16 from its fp32 accumulators gives the bits of its fp32 result
rounded afterwards -- with one CTA per tile (the main kernel's epilogue) and with the K split
over CTAs (the combine kernel's epilogue), for leaves 1, 2 and 8, from fp16 and from fp32
inputs -- the rounding the layers rely on when they ask :func:`tpinv.ops.matmul` for a rounded
product instead of an fp32 tensor.  (The interpreter computes in numpy, which has no bf16: it
loads bf16 wrongly and converts to bf16 by truncation, so bf16 is checked on the GPU only; its
dot is numpy's, so parity with the CPU reference kernel is a GPU check too.)

Negative control (this process, plain torch): rounding each leaf's fp32 sum before the leaf
tree -- a rounding in the wrong place -- changes the bits, so the equality can fail.  The GPU
run of the same checks, and the peak memory, is ``tests/gpu/test_logits_memory_cuda.py``.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from triton_interp import interpreted_test, main
from tpinv.testing import assert_bits_differ, assert_same_bits

def _interpreter_has_int1() -> bool:
    """Triton 3.2's interpreter has no ``get_int1_ty`` (the kernel's boolean counter step needs it)."""
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:
        return False
    return hasattr(InterpreterBuilder, "get_int1_ty")


pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is not None and not _interpreter_has_int1(),
                                 reason="this Triton's interpreter cannot run the matmul kernel (no get_int1_ty); "
                                        "the GPU test checks the epilogue on the device")]

M, N, K = 37, 24, 64


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=gen).to(dtype), (torch.randn(N, K, generator=gen) * 0.5).to(dtype))


def test_control_rounding_each_leaf_differs():
    from tpinv.core.contract import tree_combine
    from tpinv.kernels.reference_matmul import matmul_partial
    x, w = _inputs(torch.bfloat16)
    leaves = 8
    per_leaf = torch.stack([matmul_partial(x[:, i * 8:(i + 1) * 8],
                                           w[:, i * 8:(i + 1) * 8], 1) for i in range(leaves)], -1)
    once = tree_combine(per_leaf).to(torch.bfloat16)
    early = tree_combine(per_leaf.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert_same_bits(once, matmul_partial(x, w, leaves).to(torch.bfloat16), "one rounding at the end")
    assert_bits_differ(early, once, "leaves rounded before the tree vs one rounding at the end")


def _check_epilogue_equals_fp32_then_round():
    from tpinv.kernels import triton_matmul as tm
    from tpinv.kernels.tiles import MatmulConfig
    for dtype in (torch.float16, torch.float32):
        x, w = _inputs(dtype)
        for leaves in (1, 2, 8):
            for split in (1, 2):
                cfg = MatmulConfig(64, 32, 4, 2, split)
                rounded = tm.launch_contract(x, w, leaves, torch.float16, cfg, allow_tma=False)
                fp32 = tm.launch_contract(x, w, leaves, torch.float32, cfg, allow_tma=False)
                where = f"{dtype} inputs, leaves={leaves}, split={split}"
                assert rounded.dtype == torch.float16 and fp32.dtype == torch.float32, where
                assert_same_bits(rounded, fp32.to(torch.float16), f"{where}: epilogue vs fp32 then round")


def _with_threads(check):
    def run():
        torch.set_num_threads(1)
        check()
    return run


CHECKS = {name[1:]: _with_threads(fn) for name, fn in dict(globals()).items() if name.startswith("_check_")}
test_interpreted = interpreted_test(__file__, CHECKS)

if __name__ == "__main__":
    main(CHECKS)
