"""The GPU tile tables, checked on the host: every launch shape the tables can pick is one the
kernels accept, and no table entry depends on anything but what the contract allows.

``block_k`` (the k tile, so the order of every fp32 add) follows the dtype and the leaf length
only; the Triton launch shapes follow M, the Gluon ones M, N and the SM count (speed only; their
bits are checked equal on a GPU in tests/gpu/test_triton_matmul.py and
tests/gpu/test_gluon_matmul.py).  The Gluon dispatch never takes CPU tensors, fp32 or fewer than
``GLUON_MIN_ROWS`` rows.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.core.contract import InvarianceError
from tpinv.kernels import tiles
from tpinv.kernels.matmul_route import gluon_kernel_for

MS = (1, 17, 64, 65, 256, 257, 1000, 4096, 8192)


def test_block_k_is_the_largest_power_of_two_dividing_the_leaf():
    expect = {torch.bfloat16: {512: 64, 1536: 64, 96: 32, 48: 16, 100: 16, 1: 16},
              torch.float16: {512: 64, 96: 32},
              torch.float32: {512: 32, 96: 32, 48: 16}}
    for dtype, cases in expect.items():
        for leaf_len, bk in cases.items():
            assert tiles.block_k(dtype, leaf_len) == bk, (dtype, leaf_len)
    with pytest.raises(ValueError, match="leaf length"):
        tiles.block_k(torch.bfloat16, 0)


@pytest.mark.parametrize("leaves", [1, 2, 4, 8])
def test_every_gluon_table_entry_fits_the_kernel(leaves):
    for m in MS:
        for n in (64, 640, 4096, 6144, 24576, 151936):
            for sms in (78, 132, 144):
                cfg = tiles.gluon_launch_config(m, n, leaves, sms)
                for leaf_len in (64, 512, 1536):
                    tiles.check_gluon_config(cfg, leaves, tiles.block_k(torch.bfloat16, leaf_len))


def test_gluon_tiles_follow_the_wave_model():
    """The table's picks on 132 SMs: the widest tile for large products (Qwen3-8B at 4096 rows), one
    wave of 128x64 where it fits (o_proj and down_proj at 256 rows, a 1024 x 1024 weight gradient),
    one warpgroup's 64x(128+64) tile for qkv at 256 rows (one wave; a tree: 128x(64+32), one wave), 192
    wide for a 3072 x 1024 weight gradient (one wave; a tree keeps 128x128)."""
    def tile(m, n, leaves=1):
        cfg = tiles.gluon_launch_config(m, n, leaves, 132)
        return cfg.block_m, cfg.tile_n
    for n in (6144, 4096, 24576):
        assert tile(4096, n) == (128, 256) and tile(4096, n, 8) == (128, 128)
    assert tile(256, 4096) == (128, 64) and tile(256, 4096, 8) == (128, 64)
    assert tile(256, 6144) == (64, 192) and tile(256, 6144, 8) == (128, 96)
    assert tile(256, 24576) == (128, 128) and tile(256, 24576, 8) == (128, 128)
    assert tile(1024, 3072) == (128, 192)          # a weight gradient: one wave of 128x192
    assert tile(1024, 1024) == (128, 64)
    assert tile(256, 64 * 132 // 2) == (128, 64) and tile(256, 64 * 132 // 2 + 1) == (64, 192)
    assert tile(256, 64 * 132 // 2 + 1, 8) == (128, 96)
    assert tile(128, 6144) == (64, 128) and tile(64, 6144) == (64, 64)


def test_gluon_checks_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match="registers"):   # three live 128x256 fp32 tiles
        tiles.check_gluon_config(tiles.GluonConfig(128, 256, 8, 4), 8, 64)
    with pytest.raises(ValueError, match="shared memory"):
        tiles.check_gluon_config(tiles.GluonConfig(128, 256, 8, 6), 1, 64)
    with pytest.raises(ValueError, match="block_m"):
        tiles.check_gluon_config(tiles.GluonConfig(96, 128, 8, 4), 1, 64)


def test_tree_tiles_fill_shared_memory_with_the_staging_tile_shared():
    """Under an 8-leaf tree the epilogue's staging tile is a view of the tree's third level, so
    each table tree tile runs the most stages that fit beside that level alone; control: one stage
    more does not fit, and with leaves < 8 the staging tile counts on its own."""
    trees = {cfg for cfg, leaves in tiles.GLUON_TABLE_TILES if leaves == 8}
    assert len(trees) == 3
    for cfg in trees:
        tiles.check_gluon_config(cfg, 8, 64)
        more = tiles.GluonConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages + 1,
                                 block_n2=cfg.block_n2)
        with pytest.raises(ValueError, match="shared memory"):
            tiles.check_gluon_config(more, 8, 64)
    # 128x128: 5 stages (160 KB) and the third level (64 KB) fit only because the staging tile
    # (32 KB) has no bytes of its own; with two leaves 7 stages (224 KB) would fit alone but not
    # beside the staging tile, which then counts
    tiles.check_gluon_config(tiles.GluonConfig(128, 128, 8, 5), 8, 64)
    tiles.check_gluon_config(tiles.GluonConfig(128, 128, 8, 6), 2, 64)
    with pytest.raises(ValueError, match="shared memory"):
        tiles.check_gluon_config(tiles.GluonConfig(128, 128, 8, 7), 2, 64)


def test_gluon_dispatch_takes_only_what_it_can_run():
    w = torch.zeros(128, 256, dtype=torch.bfloat16)
    assert tiles.GLUON_MIN_ROWS > 64          # decode-sized products stay on the Triton kernel
    for m in (1, tiles.GLUON_MIN_ROWS - 1, tiles.GLUON_MIN_ROWS, 4096):
        x = torch.zeros(m, 256, dtype=torch.bfloat16)
        assert gluon_kernel_for(x, w, 8, torch.bfloat16) is None      # CPU tensors
    x = torch.zeros(4096, 256)
    assert gluon_kernel_for(x, w.float(), 8, torch.float32) is None  # fp32


# Moved from tests/gpu/test_triton_matmul.py (they need no GPU).

def test_block_k_depends_on_dtype_and_leaf_length_only():
    assert tiles.block_k(torch.bfloat16, 512) == 64
    assert tiles.block_k(torch.float16, 96) == 32
    assert tiles.block_k(torch.float32, 512) == 32
    assert tiles.block_k(torch.bfloat16, 125) == 16   # zero-padded last tile
    assert tiles.block_k(torch.bfloat16, 3) == 16     # a leaf shorter than 16 pads to 16
    with pytest.raises(InvarianceError):
        tiles.block_k(torch.int8, 64)


def test_table_configs_are_candidates_and_unknown_configs_refused():
    for m in (1, 64, 65, 256, 1000, 5000):
        for leaves in (1, 2, 8):
            assert tiles.launch_config(m, leaves) in tiles.CANDIDATE_CONFIGS
    with pytest.raises(InvarianceError, match="CANDIDATE_CONFIGS"):
        tiles.check_config(tiles.MatmulConfig(32, 32, 4, 2))
    assert tiles.MatmulConfig(64, 64, 4, 5, split=8).effective_split(2) == 2
    assert tiles.MatmulConfig(64, 64, 4, 5).effective_split(32) == 4


def test_cuda_matmul_refuses_cpu_tensors():
    pytest.importorskip("triton")
    from tpinv.kernels.matmul_route import matmul_cuda
    with pytest.raises(ValueError, match="CUDA"):
        matmul_cuda(torch.zeros(3, 64), torch.zeros(5, 64), 8)
