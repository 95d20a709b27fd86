"""The held-leaf softmax kernel compiles for sm_90 on a machine without a GPU, as launched.

The kernel's bytes are compared on a GPU (``tests/gpu/test_softmax_by_leaves.py``); here Triton's
compiler (with the ``ptxas`` its wheel ships) builds the kernel for an H100/H200 target from the
constexprs :func:`~tpinv.kernels.gluon_softmax.held_launch_options` gives a Qwen3 row, so a change
that does not compile, or that costs the table's programs their place on an SM, fails here first:

- every mode compiles, in bf16, fp16 and fp32, at the table's launch shapes;
- every mode holds both exps (the hardware ex2 alone where the leaf's least element allows it,
  Triton's general exp elsewhere); softmax also both quotients (``div_rn`` and, where the leaf
  allows it, the fused multiply-adds from the row's reciprocal), the other modes no fused
  multiply-add at all (the kernel is built without contraction);
- a program's shared memory lets the table's programs share one SM (233,472 bytes on sm_90, 1 KiB
  of it reserved per program); control: one step more of leaf would not.
"""
from __future__ import annotations

import os

import pytest
import torch

gluon_softmax = pytest.importorskip("tpinv.kernels.gluon_softmax",
                                    reason="needs a Triton with Gluon", exc_type=ImportError)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from tpinv.kernels.triton_softmax import leaf_block  # noqa: E402

QWEN3_VOCAB, LEAVES = 151936, 8
#: Shared memory an sm_90 SM gives its programs, and what each program's launch reserves.
SM90_SHARED, RESERVED_PER_PROGRAM = 233472, 1024
GENERAL_EXP, FLUSH_FREE_EXP = "ex2.approx.f32", "ex2.approx.ftz.f32"
DIVISION, FUSED_MULTIPLY_ADD = "div.rn.f32", "fma.rn.f32"


def _source():
    try:
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError:
        pytest.skip("this Triton's Gluon has no AST source to compile from")
    return GluonASTSource


def _ptxas_present() -> bool:
    try:
        path = triton.knobs.nvidia.ptxas.path
    except Exception:
        return False
    return bool(path) and os.path.exists(path)


def compile_held(dtype: torch.dtype, mode: int, leaf_len: int = QWEN3_VOCAB // LEAVES):
    """The held kernel compiled for sm_90 with the table's launch shape for ``dtype``."""
    if not _ptxas_present():
        pytest.skip("no ptxas in this Triton")
    source = _source()
    warps, per_sm, stagger = gluon_softmax.HELD_CONFIG[dtype, mode]
    options = dict(gluon_softmax.held_launch_options(
        torch.empty(0, dtype=dtype).element_size(), leaf_len, LEAVES, mode, leaf_block(leaf_len),
        warps, per_sm, stagger))
    kernel = gluon_softmax._softmax_held_kernel
    launch_options = {k: options.pop(k) for k in ("enable_fp_fusion", "maxnreg") if k in options}
    launch_options["num_warps"] = options["num_warps"]      # also the kernel's own constexpr
    element = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    signature = {"x_ptr": f"*{element}", "y_ptr": f"*{element}", "max_ptr": "*fp32",
                 "total_ptr": "*fp32", "slot_ptr": "*i64", "sync_ptr": "*i32", "n_rows": "i32",
                 "leaf_len": "i32", "stride_x": "i32", "stride_y": "i32", "stagger_ns": "i32"}
    signature.update({name: "constexpr" for name in options})
    src = source(kernel, signature, options)
    aligned = ("x_ptr", "y_ptr", "max_ptr", "total_ptr", "slot_ptr", "sync_ptr", "leaf_len",
               "stride_x", "stride_y")       # as the launcher specializes a Qwen3 row
    src.attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch_options), per_sm


@pytest.mark.parametrize("dtype", [torch.bfloat16,
                                   pytest.param(torch.float32, marks=pytest.mark.slow),
                                   pytest.param(torch.float16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode,name", [(0, "statistics"), (1, "log_softmax"), (2, "softmax")])
def test_the_held_kernel_compiles_for_sm90(dtype, mode, name):
    compiled, per_sm = compile_held(dtype, mode)
    ptx = compiled.asm["ptx"]
    assert GENERAL_EXP in ptx and FLUSH_FREE_EXP in ptx, name
    assert (DIVISION in ptx) == (mode == 2), name
    assert (FUSED_MULTIPLY_ADD in ptx) == (mode == 2), name
    shared = compiled.metadata.shared
    assert per_sm * (shared + RESERVED_PER_PROGRAM) <= SM90_SHARED, (name, shared)


def test_control_one_step_more_of_leaf_crowds_the_sm():
    """Control for the shared-memory check: a bf16 leaf one step (2048 elements) longer than
    Qwen3's 18,992 no longer lets five programs share an SM."""
    leaf_len = QWEN3_VOCAB // LEAVES + leaf_block(QWEN3_VOCAB // LEAVES)
    compiled, per_sm = compile_held(torch.bfloat16, 1, leaf_len)
    assert per_sm * (compiled.metadata.shared + RESERVED_PER_PROGRAM) > SM90_SHARED
