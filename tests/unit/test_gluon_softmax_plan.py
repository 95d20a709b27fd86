"""Where and how the held-leaf softmax kernel runs (:mod:`tpinv.kernels.gluon_softmax_plan`), and
the layout its leaf sums fold in (:mod:`tpinv.kernels.gluon_softmax_leaf`).

Host logic only (the kernel's bytes are compared on a GPU in ``tests/gpu/test_softmax_by_leaves.py``):
the table's launch shapes for a Qwen3 row, the L2 kernel where the table has no entry, no plan
where a leaf cannot be held, and the register cap that lets a plan's programs share an SM.
"""
from __future__ import annotations

import pytest
import torch

gluon_softmax_plan = pytest.importorskip("tpinv.kernels.gluon_softmax_plan",
                                         reason="needs a Triton with Gluon", exc_type=ImportError)
from tpinv.kernels import gluon_softmax_leaf  # noqa: E402

from tpinv.kernels.triton_softmax import leaf_block  # noqa: E402

QWEN3_VOCAB = 151936


def plan(width, dtype, mode=1, leaves=8, config=None):
    rows = torch.empty(2, width, dtype=dtype)
    return gluon_softmax_plan.held_plan(rows, leaves, leaf_block(width // leaves), mode, config)


def test_the_table_holds_a_qwen3_leaf():
    for mode in (0, 1, 2):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert plan(QWEN3_VOCAB, dtype, mode) == gluon_softmax_plan.HELD_CONFIG[dtype, mode]
            assert plan(QWEN3_VOCAB, dtype, mode) is not None
    assert plan(QWEN3_VOCAB, torch.bfloat16, config=(8, 1)) == (8, 1)      # an explicit shape


def test_a_case_the_table_leaves_out_goes_through_l2(monkeypatch):
    for dtype in (torch.bfloat16, torch.float16):
        assert plan(QWEN3_VOCAB, dtype, 0) == gluon_softmax_plan.HELD_CONFIG[dtype, 0]
        monkeypatch.setitem(gluon_softmax_plan.HELD_CONFIG, (dtype, 0), None)
        assert plan(QWEN3_VOCAB, dtype, 0) is None
        assert plan(QWEN3_VOCAB, dtype, 0, config=(4, 4)) == (4, 4)


def test_no_plan_where_a_leaf_cannot_be_held():
    """Control for the above: the largest leaf that fits has a plan, one step more has none
    (Qwen3's vocabulary in two leaves: 75,968 fp32 elements, 19 steps)."""
    fits = gluon_softmax_plan.SMEM_BUDGET // (4096 * 4)           # fp32 steps of 4096 lanes
    assert plan(fits * 4096 * 8, torch.float32) is not None
    assert plan((fits + 1) * 4096 * 8, torch.float32) is None
    assert plan(QWEN3_VOCAB, torch.float32, leaves=2) is None


def test_registers_are_capped_so_the_programs_an_sm_fit():
    """Five 4-warp programs an SM get 96 registers a thread (5 x 128 x 96 fits the 65,536; the
    next allocation step, 104, does not); four or fewer, and fp32's two, need no cap."""
    cap = gluon_softmax_plan.register_cap
    registers = gluon_softmax_plan.REGISTERS_PER_SM
    assert cap(4, 5) == 96
    assert 5 * 4 * 32 * 96 <= registers < 5 * 4 * 32 * 104
    assert cap(4, 6) == 80 and cap(8, 4) == 64
    assert cap(4, 4) is None and cap(4, 2) is None and cap(8, 2) is None
    assert cap(4, 0.01) is None                              # a fraction of an SM is one program
    warps, per_sm, _ = gluon_softmax_plan.HELD_CONFIG[torch.bfloat16, 1]
    assert cap(warps, per_sm) is not None                    # the table's bf16 shape is capped


def held_lanes(layout, warp):
    """The lanes each (register, thread) of ``warp`` holds in a 1-D linear ``layout``."""
    def at(bases, index):
        out = 0
        for bit, (basis,) in enumerate(bases):
            if index >> bit & 1:
                out ^= basis
        return out
    return [[at(layout.reg_bases, r) ^ at(layout.lane_bases, t) ^ at(layout.warp_bases, warp)
             for r in range(1 << len(layout.reg_bases))] for t in range(32)]


@pytest.mark.parametrize("lanes,num_warps",
                         [(1024, 4), (512, 4), (1024, 8), (64, 4), (8, 4), (1, 4)])
def test_the_fold_layout_gives_every_warp_all_the_lanes(lanes, num_warps):
    """The fold's exchange (``fold_lanes``): every warp holds each of the remaining lanes, a
    thread four contiguous ones (one vector load) and, from 128 lanes on, the same four of every
    128 -- so the halving levels at distances of 128 and more are a thread's own adds."""
    layout = gluon_softmax_leaf.fold_layout_of(lanes, num_warps)
    assert len(layout.lane_bases) == 5 and len(layout.warp_bases) == num_warps.bit_length() - 1
    for warp in range(num_warps):
        held = held_lanes(layout, warp)
        assert sorted({lane for thread in held for lane in thread}) == list(range(lanes))
        assert held == held_lanes(layout, 0)                 # the warps hold the same lanes
    thread = held_lanes(layout, 0)[1]
    if lanes >= 128:
        assert thread[:4] == [4, 5, 6, 7] and thread[4] == 4 + 128
    # control: a layout whose warps split the lanes would fail the check above
    split = gluon_softmax_leaf.gl.DistributedLinearLayout(layout.reg_bases, layout.lane_bases,
                                                          [[lanes // 2]] + layout.warp_bases[1:],
                                                          [], [lanes])
    if lanes >= 2:
        assert held_lanes(split, 1) != held_lanes(split, 0)


def test_the_tiles_a_leaf_is_read_in():
    """A tile is one row-layout tile's lanes (bf16: 8 a thread, fp32: 4; 32 threads a warp), at
    most the block; a Qwen3 leaf (18,992 elements, blocks of 4,096) has 2,608 in its last step:
    in 1,024-lane tiles two full and a partial one, so the fourth tile of that step is never
    read, copied or written; a leaf of whole tiles has no partial one."""
    tile, live = gluon_softmax_leaf.tile_lanes_of, gluon_softmax_leaf.live_tiles
    assert tile(8, 4, 4096) == 1024 and tile(4, 8, 4096) == 1024 and tile(4, 4, 4096) == 512
    assert tile(8, 8, 2048) == 2048 and tile(8, 16, 2048) == 2048
    assert live(QWEN3_VOCAB // 8, 4096, 1024) == (3, True)
    assert live(QWEN3_VOCAB // 8, 4096, 512) == (6, True)
    assert live(4 * 4096, 4096, 1024) == (4, False)          # control: no step past the end
    assert live(4096 + 1024, 4096, 1024) == (1, False)
    assert live(2048, 2048, 2048) == (1, False)
    # the kernel's predicates over a Qwen3 leaf: 4 steps of 4 tiles and 3 of the last step hold
    # elements, and only the last of those is partial; a leaf of whole tiles has none partial
    holds, partial = gluon_softmax_leaf.tile_holds_elements, gluon_softmax_leaf.tile_is_partial
    grid = [(k, t) for k in range(5) for t in range(4)]
    assert sum(holds(k, t, 5, 3) for k, t in grid) == 19
    assert [(k, t) for k, t in grid if partial(k, t, 5, 3, True)] == [(4, 2)]
    assert not any(partial(k, t, 5, 2, False) for k, t in grid)
