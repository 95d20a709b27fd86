"""The held-leaf softmax kernel compiles for sm_90 on a machine without a GPU, as launched.

The kernel's bytes are compared on a GPU (``tests/gpu/test_softmax_by_leaves.py``); here Triton's
compiler (with the ``ptxas`` its wheel ships) builds the kernel for an H100/H200 target from the
constexprs :func:`~tpinv.kernels.gluon_softmax_plan.held_launch_options` gives a Qwen3 row, so a
change that does not compile, or that costs the table's programs their place on an SM, fails here
first:

- every mode compiles, in bf16, fp16 and fp32, at the table's launch shapes;
- every mode holds both exps (the hardware ex2 alone where the leaf's least element allows it,
  Triton's general exp elsewhere); softmax also both quotients (``div_rn`` and, where the leaf
  allows it, the fused multiply-adds from the row's reciprocal), the other modes no fused
  multiply-add at all (the kernel is built without contraction);
- a program's shared memory lets the table's programs share one SM (233,472 bytes on sm_90, 1 KiB
  of it reserved per program); control: one step more of leaf would not;
- 16-bit log_softmax needs no local memory at its register cap (control: a lower cap spills);
- a leaf's last step copies and computes only its tiles that hold elements (control: a leaf of
  whole steps computes every lane), and fp32 softmax, keeping its exps, takes one an element;
- in both kernels the max pass reads a leaf's steps as their copies land, one cp.async group a
  step (control: a leaf of one step waits for all of it);
- bf16's max pass takes signed and unsigned maxima of the raw bits, with no bf16 min/max
  instruction left (control: fp16's compares in fp16, with no integer maximum);
- the cluster kernel's meetings hold no memory fence (asynchronous stores and mbarrier waits).
"""
from __future__ import annotations

import os
import re

import pytest
import torch

gluon_softmax = pytest.importorskip("tpinv.kernels.gluon_softmax",
                                    reason="needs a Triton with Gluon", exc_type=ImportError)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from tpinv.kernels import gluon_softmax_leaf, gluon_softmax_plan  # noqa: E402
from tpinv.kernels.launch import cdiv  # noqa: E402
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


def _compile(kernel, dtype: torch.dtype, mode: int, leaf_len: int, pointer: str = "slot_ptr",
             maxnreg: int | None = None, prefetch: bool | None = None):
    """``kernel`` (launched as :func:`~tpinv.kernels.gluon_softmax.softmax_rows_held` launches it;
    ``pointer``: its fifth parameter, the ticket kernel's meeting slots or the cluster kernel's
    logsumexp output) compiled for sm_90 with the table's launch shape for ``dtype``
    (``maxnreg``: another register cap; ``prefetch``: the cluster's ``PREFETCH`` other than the
    plan's); returns it and the table's programs an SM."""
    if not _ptxas_present():
        pytest.skip("no ptxas in this Triton")
    source = _source()
    warps, per_sm, stagger = gluon_softmax_plan.HELD_CONFIG[dtype, mode]
    lse = None                       # the cluster kernel's own constexprs, as its launch sets them
    if pointer == "lse_ptr":
        lse = mode == 0              # the statistics write each row's logsumexp
        if prefetch is None:
            prefetch = (dtype, mode) in gluon_softmax_plan.PREFETCHED
    options = dict(gluon_softmax_plan.held_launch_options(
        torch.empty(0, dtype=dtype).element_size(), leaf_len, LEAVES, mode, leaf_block(leaf_len),
        warps, per_sm, stagger, lse, prefetch))
    launch_options = {k: options.pop(k) for k in ("enable_fp_fusion", "maxnreg") if k in options}
    launch_options["num_warps"] = options["num_warps"]      # also the kernel's own constexpr
    if maxnreg is not None:
        launch_options["maxnreg"] = maxnreg
    element = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    signature = {"x_ptr": f"*{element}", "y_ptr": f"*{element}", "max_ptr": "*fp32",
                 "total_ptr": "*fp32", pointer: "*i64" if pointer == "slot_ptr" else "*fp32",
                 "sync_ptr": "*i32", "n_rows": "i32", "leaf_len": "i32", "stride_x": "i32",
                 "stride_y": "i32", "stagger_ns": "i32"}
    signature.update({name: "constexpr" for name in options})
    src = source(kernel, signature, options)
    aligned = [n for n in signature if n.endswith("_ptr")] + ["leaf_len", "stride_x", "stride_y"]
    src.attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch_options), per_sm


def compile_held(dtype: torch.dtype, mode: int, leaf_len: int = QWEN3_VOCAB // LEAVES,
                 maxnreg: int | None = None):
    """The held kernel compiled for sm_90 with the table's launch shape for ``dtype``."""
    return _compile(gluon_softmax._softmax_held_kernel, dtype, mode, leaf_len, maxnreg=maxnreg)


def _sass(compiled) -> str:
    """The compiled program's sm_90 SASS, from the ``nvdisasm`` Triton's wheel ships (the test
    skipped where it has none; the compile itself is not guarded)."""
    try:
        return compiled.asm["sass"]
    except Exception as error:     # no nvdisasm: nothing to read
        pytest.skip(f"no SASS from this Triton: {error}")


def _local_memory_accesses(compiled) -> int:
    """The sm_90 SASS's local loads and stores (register spills)."""
    return len(re.findall(r"\b(?:LDL|STL)\b", _sass(compiled)))


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


def test_bf16_elements_widen_by_bit_operations():
    """A bf16 program widens its held elements to fp32 as bit operations on pairs (the low half
    shifted up, the high half masked: :func:`~tpinv.kernels.gluon_softmax_leaf.widened`), two
    instructions a pair, the leaf's max and floor too (from their raw bits:
    :func:`~tpinv.kernels.gluon_softmax_extremes.leaf_extremes`), so no ``cvt`` is left.
    Control: the fp16 program, whose widening is a real conversion, converts every
    element it reads (152 a thread in each of the statistics' two passes over shared memory
    that need fp32: fewer than that would mean an element was not read)."""
    ptx = compile_held(torch.bfloat16, 0)[0].asm["ptx"]
    assert ptx.count("cvt.f32.bf16") == 0
    assert ptx.count("0xFFFF0000") >= 152 // 2          # the high halves' mask, one a pair
    half = compile_held(torch.float16, 0)[0].asm["ptx"]
    assert half.count("cvt.f32.f16") >= 152


def test_16bit_log_softmax_does_not_spill_at_its_register_cap():
    """bf16 log_softmax runs five programs an SM, its registers capped at 96
    (:func:`~tpinv.kernels.gluon_softmax_plan.register_cap`); the block barrier after the row-max
    meeting keeps the compiler from holding the max pass's shared-memory loads live into the sum
    pass, so neither kernel's program (a cluster's, as the table runs Qwen3's leaves of 8, and
    the ticket kernel's, for other leaf counts) needs local memory.  Control: the ticket
    kernel's program capped at 64 registers spills (the count can see a spill)."""
    assert _local_memory_accesses(compile_clustered(torch.bfloat16, 1)[0]) == 0
    compiled, _ = compile_held(torch.bfloat16, 1)
    assert gluon_softmax_plan.held_launch_options(2, QWEN3_VOCAB // LEAVES, LEAVES, 1,
                                                  leaf_block(QWEN3_VOCAB // LEAVES),
                                                  *gluon_softmax_plan.HELD_CONFIG[torch.bfloat16, 1]
                                                  )["maxnreg"] == 96
    assert _local_memory_accesses(compiled) == 0
    assert _local_memory_accesses(compile_held(torch.bfloat16, 1, maxnreg=64)[0]) > 0


def test_control_one_step_more_of_leaf_crowds_the_sm():
    """Control for the shared-memory check: a bf16 leaf one step (2048 elements) longer than
    Qwen3's 18,992 no longer lets five programs share an SM."""
    leaf_len = QWEN3_VOCAB // LEAVES + leaf_block(QWEN3_VOCAB // LEAVES)
    compiled, per_sm = compile_held(torch.bfloat16, 1, leaf_len)
    assert per_sm * (compiled.metadata.shared + RESERVED_PER_PROGRAM) > SM90_SHARED


def test_only_the_leaf_s_live_tiles_are_computed():
    """A Qwen3 leaf (18,992 elements in 5 steps of 4,096 lanes) is 19,456 lanes once its last
    step's empty tile is skipped: a thread of the bf16 statistics program (128 threads) copies
    38 16-byte pieces and takes 152 exps of each kind (the flush-free and the general one);
    control: a leaf of 5 whole steps, 40 and 160.  fp32 softmax, which keeps its sum's exps for
    its quotients, takes no more exps than the statistics but for the two tiles the table's fp32
    leaves read from memory (:func:`~tpinv.kernels.gluon_softmax_plan.held_buffers`; their exps are
    taken again), and its block barriers stay at about one a tile of its sum (each tile read
    whole before its exps are written), not one a step."""
    def counts(dtype, mode, leaf_len=QWEN3_VOCAB // LEAVES):
        ptx = compile_held(dtype, mode, leaf_len)[0].asm["ptx"]
        return (ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), ptx.count(FLUSH_FREE_EXP),
                ptx.count(GENERAL_EXP), ptx.count("bar.sync"))
    threads = 32 * gluon_softmax_plan.HELD_CONFIG[torch.bfloat16, 0][0]       # 128 in the table
    live, whole = 19456 // threads, 5 * 4096 // threads
    assert counts(torch.bfloat16, 0)[:3] == (live // 4, live, live)     # 8 bf16 a copy
    assert counts(torch.bfloat16, 0, 5 * 4096)[:3] == (whole // 4, whole, whole)
    _, free, general, barriers = counts(torch.float32, 2)
    _, stats_free, stats_general, stats_barriers = counts(torch.float32, 0)
    # the tiles the table's fp32 shape reads from memory (not held) take their exps again
    warps, per_sm, stagger = gluon_softmax_plan.HELD_CONFIG[torch.float32, 2]
    options = gluon_softmax_plan.held_launch_options(4, QWEN3_VOCAB // LEAVES, LEAVES, 2,
                                                leaf_block(QWEN3_VOCAB // LEAVES), warps, per_sm,
                                                stagger)
    again = (options["LIVE"] - options["HELD"]) * options["VEC"]
    assert (free, general) == (stats_free + again, stats_general + again)
    warps = gluon_softmax_plan.HELD_CONFIG[torch.float32, 2][0]
    block = leaf_block(QWEN3_VOCAB // LEAVES)
    tiles = block // gluon_softmax_leaf.tile_lanes_of(4, warps, block)     # 4 fp32 a thread
    assert barriers <= stats_barriers + 2 * tiles + 2, (barriers, stats_barriers)


def compile_clustered(dtype: torch.dtype, mode: int, leaf_len: int = QWEN3_VOCAB // LEAVES,
                      prefetch: bool | None = None):
    """The cluster kernel (:mod:`tpinv.kernels.gluon_softmax_cluster`) compiled for sm_90 with
    the table's launch shape for ``dtype`` (``prefetch``: other than the plan's)."""
    from tpinv.kernels import gluon_softmax_cluster
    return _compile(gluon_softmax_cluster._softmax_cluster_kernel, dtype, mode, leaf_len,
                    "lse_ptr", prefetch=prefetch)


#: The output pass's vector stores to global memory, and a copy from global to shared memory.
VECTOR_STORE = re.compile(r"\bst\.global\S*\.v[248]\.")
ASYNC_COPY = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\b")


def _copies_among_output_stores(ptx: str) -> int:
    """How many of the program's copies lie between its first and last vector store in the PTX."""
    lines = ptx.splitlines()
    stores = [i for i, line in enumerate(lines) if VECTOR_STORE.search(line)]
    return sum(stores[0] < i < stores[-1] for i, line in enumerate(lines)
               if ASYNC_COPY.search(line))


@pytest.mark.parametrize("dtype,mode", [(torch.bfloat16, 2),
                                        pytest.param(torch.bfloat16, 1, marks=pytest.mark.slow),
                                        pytest.param(torch.float32, 1, marks=pytest.mark.slow),
                                        pytest.param(torch.float32, 2, marks=pytest.mark.slow)])
def test_the_cluster_copies_its_next_row_during_the_output_pass(dtype, mode):
    """Where :data:`~tpinv.kernels.gluon_softmax_plan.PREFETCHED` names the program, the copies
    of the cluster's next row lie among the output pass's stores (each held tile copied once
    the pass has written it); elsewhere every copy comes before the output's first store or
    after its last.  Control, by construction: the same program with the flag flipped."""
    prefetched = (dtype, mode) in gluon_softmax_plan.PREFETCHED
    for flag in (prefetched, not prefetched):
        ptx = compile_clustered(dtype, mode, prefetch=flag)[0].asm["ptx"]
        among = _copies_among_output_stores(ptx)
        assert (among > 0) == flag, (flag, among, len(ASYNC_COPY.findall(ptx)))


#: The meetings' static shared array (four mbarriers, then [kind][parity][set][8] slot words),
#: beside the dynamic shared memory Triton sizes.
MEETINGS_BYTES = 288


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_the_cluster_kernel_meets_in_shared_memory(dtype, mode):
    """A row's leaves meet by storing into each other's shared memory (``mapa`` and
    ``st.async``, completing on the receiver's mbarrier) and waiting on their own mbarrier (two
    meetings a row; the statistics alone meet once a row, for the max, with the previous row's
    leaf sums carried in that meeting's second set of slots, and once more after the loop for
    the last row's sums: two meetings in the program, three stores, no global slots at all),
    never by polling global memory; the only cluster barriers are the one after the mbarriers'
    initialization and the one before a program exits; a program with its meetings' array still
    lets the table's programs share an SM.  Control: the ticket kernel polls its row's slots in
    global memory."""
    compiled, per_sm = compile_clustered(dtype, mode)
    ptx = compiled.asm["ptx"]
    stores = 3 if mode == 0 else 2
    assert ptx.count("barrier.cluster.arrive.release") == 2
    assert ptx.count("barrier.cluster.wait.acquire") == 2
    assert ptx.count("st.async.shared::cluster.mbarrier::complete_tx::bytes") == stores
    assert ptx.count("mapa.shared::cluster") == 2 * 2            # a slot and an mbarrier a meeting
    assert ptx.count("mbarrier.try_wait.parity") == 2
    assert ptx.count("mbarrier.init.shared::cta") == 4
    assert "st.shared::cluster" not in ptx
    assert "atom.global.gpu.relaxed.exch" not in ptx
    assert "ld.volatile.global" not in ptx
    assert f".shared .align 16 .b8 tpinv_meetings[{MEETINGS_BYTES}]" in ptx
    shared = compiled.metadata.shared + MEETINGS_BYTES
    assert per_sm * (shared + RESERVED_PER_PROGRAM) <= SM90_SHARED, shared
    assert "ld.volatile.global" in compile_held(dtype, mode)[0].asm["ptx"]


WAIT_GROUP = re.compile(r"cp\.async\.wait_group\s+(\d+);")
SHARED_LOAD = re.compile(r"\bld\.shared\.")


@pytest.mark.parametrize("compile_program", [compile_held, compile_clustered],
                         ids=["tickets", "cluster"])
def test_the_max_pass_reads_each_step_as_its_copy_lands(compile_program):
    """A leaf's copies close as one cp.async group a step, and the max pass waits for its steps
    one at a time (``wait_group STEPS - 1 - k`` before step ``k``), reading each step before the
    next has landed: the table's bf16 Qwen3 leaf (18,992 elements, five steps of 4096) waits for
    4, 3, 2, 1, 0 groups in flight, with shared-memory loads between one wait and the next.
    Control, by construction: a leaf of one step (2048 elements) can only wait for all of it."""
    leaf_len = QWEN3_VOCAB // LEAVES
    steps = cdiv(leaf_len, leaf_block(leaf_len))
    ptx = compile_program(torch.bfloat16, 0, leaf_len)[0].asm["ptx"]
    waits = [(m.start(), int(m.group(1))) for m in WAIT_GROUP.finditer(ptx)]
    assert steps == 5 and [n for _, n in waits] == list(range(steps - 1, -1, -1)), waits
    for (here, _), (there, _) in zip(waits, waits[1:]):
        assert SHARED_LOAD.search(ptx, here, there), "a step read before the next one landed"
    one_step = compile_program(torch.bfloat16, 0, 2048)[0].asm["ptx"]
    assert [int(n) for n in WAIT_GROUP.findall(one_step)] == [0]


#: sm_90 SASS: a 16-bit pair's signed and unsigned integer maxima (two or three inputs), and a
#: bf16 pair's min/max.
SIGNED_PAIR_MAX = re.compile(r"\bVIMNMX3?\.S16x2\b")
UNSIGNED_PAIR_MAX = re.compile(r"\bVIMNMX3?\.U16x2\b")
BF16_MIN_MAX = re.compile(r"\bV?HMNMX2?\.BF16")


@pytest.mark.parametrize("compile_program", [compile_held, compile_clustered],
                         ids=["tickets", "cluster"])
def test_bf16_s_max_pass_compares_raw_bits(compile_program):
    """The max pass of bf16 statistics (:func:`~tpinv.kernels.gluon_softmax_extremes.leaf_extremes`)
    takes a signed and an unsigned maximum of the elements' raw bits, two a register, and no
    bf16 min/max is left in the program; control: fp16's compares in fp16 and has no integer
    pair maximum."""
    bf16, fp16 = (_sass(compile_program(dtype, 0)[0]) for dtype in (torch.bfloat16, torch.float16))
    assert SIGNED_PAIR_MAX.search(bf16) and UNSIGNED_PAIR_MAX.search(bf16)
    assert not BF16_MIN_MAX.search(bf16)
    assert not (SIGNED_PAIR_MAX.search(fp16) or UNSIGNED_PAIR_MAX.search(fp16))
    assert re.search(r"\bV?HMNMX2?\b", fp16)


#: sm_90 SASS: a memory fence, an asynchronous store to a cluster peer's shared memory, and an
#: mbarrier phase wait.
MEMORY_FENCE = re.compile(r"\bMEMBAR\b")
PEER_STORE = re.compile(r"\bSTAS\b")
PHASE_WAIT = re.compile(r"\bSYNCS\.PHASECHK\b")


@pytest.mark.parametrize("dtype,mode", [(torch.float32, 0), (torch.float32, 1),
                                        (torch.bfloat16, 1), (torch.bfloat16, 2)])
def test_cluster_meetings_hold_no_fence(dtype, mode):
    """A row's meetings in the cluster kernel (:mod:`~tpinv.kernels.gluon_softmax_cluster`) are
    asynchronous stores to every program's slots that complete on its mbarrier, and waits on
    the program's own: no memory fence in the row loop, which would wait for the program's
    earlier global stores.  The program's only fences are the two cluster barriers before its
    first row and before it exits (two each), and the count sees them (the control: a meeting
    with a fence, two a meeting, would make 8)."""
    sass = _sass(compile_clustered(dtype, mode)[0])
    assert PEER_STORE.search(sass) and PHASE_WAIT.search(sass)
    assert len(MEMORY_FENCE.findall(sass)) == 4
