"""The fixed tile table of the GPU contract matmul, in one place.

Invariant kept here: ``BLOCK_K`` -- the tile of the k chain inside each leaf, and so
the order of every fp32 accumulation -- depends only on the input dtype and on the
leaf length ``K / leaves``; never on M, N, the TP size or the launch shape.  A leaf
always starts a fresh chain at its own first k; a leaf whose length is not a multiple
of ``BLOCK_K`` (or is shorter than 16) is zero-padded in its last tile.

Everything else about a launch -- BLOCK_M, BLOCK_N, warps, pipeline stages and how
many CTAs share the leaves of one output tile (``split``) -- may follow M for speed,
because none of it changes a single addition: every config in :data:`CANDIDATE_CONFIGS`
is checked to give the same bits as every other one (tests/gpu/test_triton_matmul.py).
The same holds for the warp-specialized Gluon kernel's table (:class:`GluonConfig`,
:data:`GLUON_MIN_ROWS`), checked against the Triton kernel (tests/gpu/test_gluon_matmul.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tpinv.core.contract import InvarianceError, check_dtype

#: Shortest k tile of a leaf chain: a leaf shorter than this is zero-padded up to it.
MIN_BLOCK_K = 16

#: Longest k tile per input dtype (16-bit inputs: tensor-core tiles; fp32: exact FMA chain).
_MAX_BLOCK_K = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}


def block_k(dtype: torch.dtype, leaf_len: int) -> int:
    """The k tile of a leaf chain: the largest power of two <= the dtype's maximum that
    divides ``leaf_len`` (at least :data:`MIN_BLOCK_K`; a remainder is zero-padded)."""
    check_dtype(dtype)
    if not isinstance(leaf_len, int) or leaf_len < 1:
        raise ValueError(f"leaf length must be a positive int, got {leaf_len!r}")
    bk = _MAX_BLOCK_K[dtype]
    while bk > MIN_BLOCK_K and leaf_len % bk:
        bk //= 2
    return bk


#: Leaves one CTA may hold (a saved register tile per tree level: log2 of this).
MAX_LEAVES_PER_CTA = 8


@dataclass(frozen=True)
class MatmulConfig:
    """One launch shape of the contract matmul (none of it moves a bit)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split: int = 1        # CTAs per output tile along K; each owns leaves/split whole leaves
    group_m: int = 8      # output-tile swizzle for L2 reuse

    def effective_split(self, leaves: int) -> int:
        """CTAs per output tile for ``leaves`` (a power of two dividing leaves)."""
        return max(min(self.split, leaves), leaves // MAX_LEAVES_PER_CTA)

    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}k{self.split}"


def _c(bm, bn, w, s, split=1):
    return MatmulConfig(bm, bn, w, s, split)


#: Every launch shape the library may use.  BLOCK_M >= 64 keeps every tile on the same
#: (Hopper wgmma) tensor-core path.  Each one is proven bit-identical to the others.
#: Tiles for leaves > 1 hold log2(leaves) saved fp32 tiles beside the running one, so
#: they are small (32 registers a tile a thread); large tiles are for one leaf.
CANDIDATE_CONFIGS: tuple[MatmulConfig, ...] = (
    # one 64-row tile (decode), narrow to wide
    _c(64, 32, 4, 6), _c(64, 64, 4, 5), _c(64, 128, 4, 4), _c(64, 128, 8, 4), _c(64, 256, 8, 4),
    # 128-row tiles
    _c(128, 64, 4, 4), _c(128, 64, 8, 4), _c(128, 64, 8, 5), _c(128, 128, 8, 4),
    _c(128, 128, 8, 5),
    # large tiles (one leaf per CTA only: a saved 128x256 fp32 tile is 128 registers a thread)
    _c(128, 256, 8, 3), _c(128, 256, 8, 4), _c(256, 128, 8, 3), _c(256, 128, 8, 4),
    # leaves shared among CTAs, sub-trees combined by the top of the tree
    _c(64, 32, 4, 6, split=2), _c(64, 64, 4, 5, split=2), _c(64, 64, 4, 5, split=4),
    _c(64, 64, 4, 5, split=8), _c(128, 64, 8, 4, split=2), _c(128, 128, 8, 4, split=2),
    _c(128, 128, 8, 4, split=4),
)

#: (largest M of the bucket, config for leaves == 1, config for leaves > 1); the last
#: bucket has no bound.  Chosen by the geometric-mean speed over the Qwen3-8B shapes in
#: the H100 sweep of docs/benchmarks.md (M=32, 256, 4096; the 257..1024 bucket is not
#: measured and takes large-M tiles with more CTAs).
_TABLE: tuple[tuple[int | None, MatmulConfig, MatmulConfig], ...] = (
    (64, _c(64, 64, 4, 5), _c(64, 64, 4, 5, split=2)),
    (256, _c(128, 64, 4, 4), _c(64, 64, 4, 5)),
    (1024, _c(128, 128, 8, 4), _c(128, 128, 8, 4, split=2)),
    (None, _c(256, 128, 8, 4), _c(128, 128, 8, 4, split=2)),
)


def launch_config(m: int, leaves: int) -> MatmulConfig:
    """The table's launch shape for ``m`` rows (a speed choice; never a numerics one)."""
    for bound, one_leaf, tree in _TABLE:
        if bound is None or m <= bound:
            return one_leaf if leaves == 1 else tree
    raise AssertionError("unreachable: the last bucket has no bound")


def check_config(config: MatmulConfig) -> MatmulConfig:
    """Only launch shapes proven bit-identical may run."""
    if config not in CANDIDATE_CONFIGS:
        raise InvarianceError(
            f"launch config {config} is not one of tiles.CANDIDATE_CONFIGS; only configs "
            f"checked to give identical bits may run (add it there and to the GPU tests)")
    return config


# ---- the warp-specialized Gluon kernel (tpinv.kernels.gluon_matmul): same BLOCK_K, same bits

#: Rows from which a bf16/fp16 product on sm_90 runs the Gluon kernel; fewer rows run the
#: Triton kernel, whose table may split K across CTAs for them.  Both give the same bits
#: (tests/gpu/test_gluon_matmul.py), so this is a speed choice.
GLUON_MIN_ROWS = 65


@dataclass(frozen=True)
class GluonConfig:
    """One launch shape: BM = 64 rows per consumer warpgroup.  Tiles, warps and stages
    never move a bit; ``zero_acc`` picks how a leaf's chain starts (see below)."""

    block_m: int
    block_n: int
    num_warps: int      # consumer warps (4 per warpgroup); the producer adds one warp
    num_stages: int
    group_m: int = 8
    producer_regs: int = 40
    # True: each leaf's chain starts from a +0 tile with every wgmma accumulating (scale-d
    # 1), the instruction sequence of the Triton kernel.  False: the leaf's first wgmma
    # ignores the accumulator (scale-d 0), one tile of zeroing moves fewer per leaf.
    zero_acc: bool = True
    # A second accumulator beside the first, block_n2 columns wide (0: none): tiles whose
    # width is not a power of two (128x96 = 64 + 32) fill the SMs in one wave where the
    # power-of-two widths leave a quarter of them idle or take a second wave.
    block_n2: int = 0

    @property
    def tile_n(self) -> int:
        """The output tile's width: ``block_n + block_n2`` columns."""
        return self.block_n + self.block_n2

    def name(self) -> str:
        width = f"{self.block_n}+{self.block_n2}" if self.block_n2 else f"{self.block_n}"
        return (f"{self.block_m}x{width}w{self.num_warps}s{self.num_stages}"
                + ("" if self.group_m == 8 else f"g{self.group_m}")
                + ("" if self.zero_acc else " scale-d0"))


#: The tiles of more than 128 rows the Gluon table picks from (one leaf; a tree), and the relative
#: speed of an SM on each tile (output elements per second, the 128x256 tile's = 1; keyed by rows and
#: width; from the H200 sweeps of docs/benchmarks.md, 2026-11-26 and 2026-11-28).
#: Stages are the most that fit beside the epilogue's 16-bit staging tile (the TMA store); under an
#: 8-leaf tree, beside the tree's third fp32 level, whose bytes the staging tile shares.
_GLUON_ONE_LEAF = (GluonConfig(128, 256, 8, 3), GluonConfig(128, 128, 8, 4, block_n2=64),
                   GluonConfig(128, 128, 8, 6), GluonConfig(128, 64, 8, 7, block_n2=32),
                   GluonConfig(128, 64, 8, 8), GluonConfig(64, 128, 4, 6, block_n2=64))
_GLUON_TREE = (GluonConfig(128, 128, 8, 5), GluonConfig(128, 64, 8, 6, block_n2=32),
               GluonConfig(128, 64, 8, 8))
_TILE_RATE = {(128, 256): 1.0, (128, 192): 1.0, (128, 128): 0.96, (128, 96): 0.74, (128, 64): 0.8}
#: One leaf's rates: the 64-wide tile over several waves ran at 0.56 of 128x256's rate in a weight
#: gradient (3072 x 1024 output, K = 4096, both operands transposed; H100 sweep of the Qwen3-0.6B
#: training step's matmuls, docs/benchmarks.md, 2026-11-26): 0.7 keeps it where one wave of it
#: fills the SMs (the 256-row products) and gives such gradients 128x256.  The 192-wide tile runs
#: 4 stages beside the epilogue's staging tile (5 before): gate_up at 256 rows took 91.3 us in two
#: waves of it against 86.3 us in three of 128x128 (H100 sweep with the TMA-store epilogue,
#: docs/benchmarks.md, 2026-11-26, evening), a rate of about 0.9.  One warpgroup on a 64x(128+64)
#: tile: Qwen3-8B's qkv at 256 rows (one wave of 128 tiles either way) took 22.0 and 22.5 us against
#: 23.2 and 25.9 us on 128x(64+32), on two H200s (docs/benchmarks.md, 2026-11-28): 0.78.
_TILE_RATE_ONE_LEAF = {**_TILE_RATE, (128, 64): 0.7, (128, 192): 0.9, (64, 192): 0.78}
#: Every (config, leaves) the table above 128 rows may launch (the GPU tests run each one).
GLUON_TABLE_TILES = tuple((cfg, leaves) for cfg in _GLUON_ONE_LEAF for leaves in (1,)) + tuple(
    (cfg, leaves) for cfg in _GLUON_TREE for leaves in (2, 4, 8))


def gluon_launch_config(m: int, n: int, leaves: int, sms: int) -> GluonConfig:
    """The Gluon kernel's tile for an ``m x n`` output on ``sms`` SMs: a speed choice only.

    One leaf cannot split K, so the grid of output tiles is all the parallelism there is.  Above
    128 rows the table takes the tile that finishes first by a wave model: ``ceil(tiles / sms)``
    waves, each as long as a tile's outputs over its rate (:data:`_TILE_RATE`; a tie goes to the
    tile listed first).  Large products keep the widest tile (Qwen3-8B's shapes at 4096 rows:
    128x256, 128x128 for a tree); at 256 rows o_proj and down_proj take 128x64 (one wave of 128
    tiles), qkv takes 64x(128+64) (one wave of 128 tiles where 128x128 leaves 36 SMs idle; a tree
    128x(64+32)) and gate_up 128x128 (three waves; two of the 192-wide tile ran slower with its 4
    stages); a weight gradient of few output tiles (1024 x 1024: 32 tiles of 128x256) takes 128
    tiles of 128x64, one of 3072 x 1024 128x256 (one wave, where 128x64 took three at a lower rate).
    Rates are from H200 sweeps at 256 rows (2026-11-26, 2026-11-28): the two-accumulator tiles run
    their wgmmas narrower, so 96 columns go at 0.74 of 128x256's rate, 192 at about its rate (0.9
    for one leaf, whose 192-wide tile has one stage fewer beside the epilogue's staging tile), and
    one warpgroup's 64x(128+64) at 0.78."""
    if m <= 64:
        return GluonConfig(64, 64, 4, 8)
    if m <= 128:
        return GluonConfig(64, 128, 4, 6)

    rate = _TILE_RATE_ONE_LEAF if leaves == 1 else _TILE_RATE

    def finish(cfg: GluonConfig) -> float:
        waves = -(-(-(-m // cfg.block_m) * -(-n // cfg.tile_n)) // sms)
        return waves * cfg.block_m * cfg.tile_n / rate[(cfg.block_m, cfg.tile_n)]

    return min(_GLUON_ONE_LEAF if leaves == 1 else _GLUON_TREE, key=finish)


def gluon_staging_bytes(cfg: GluonConfig, leaves: int) -> int:
    """Shared memory the epilogue's 16-bit staging tile takes of its own: none under an 8-leaf
    tree, whose third fp32 level it is a view of."""
    return 0 if leaves == 8 else cfg.block_m * cfg.tile_n * 2


def check_gluon_config(cfg: GluonConfig, leaves: int, bk: int) -> None:
    """Shapes the kernel is built for: wgmma rows per warp, registers, shared memory."""
    if cfg.num_warps not in (4, 8) or cfg.block_m != 16 * cfg.num_warps:
        raise ValueError(f"{cfg}: block_m must be 16 * num_warps with 4 or 8 warps")
    if cfg.block_n not in (64, 128, 256) or cfg.num_stages < 2:
        raise ValueError(f"{cfg}: block_n must be 64, 128 or 256 and num_stages >= 2")
    if cfg.block_n2 not in (0, 32, 64) or (cfg.block_n2 and cfg.block_n2 >= cfg.block_n):
        raise ValueError(f"{cfg}: block_n2 must be 0, 32 or 64 and narrower than block_n")
    tiles_live = {1: 1, 2: 2}.get(leaves, 3)
    regs = tiles_live * cfg.block_m * cfg.tile_n // (32 * cfg.num_warps)
    if regs > 192:
        raise ValueError(f"{cfg}: {tiles_live} live fp32 tiles need {regs} registers a thread")
    smem = cfg.num_stages * (cfg.block_m + cfg.tile_n) * bk * 2 + gluon_staging_bytes(cfg, leaves)
    smem += cfg.block_m * cfg.tile_n * 4 if leaves == 8 else 0   # the tree's third level
    if smem > 227 * 1024 - 1024:
        raise ValueError(f"{cfg}: {smem} bytes of shared memory is over the 227 KB limit")
