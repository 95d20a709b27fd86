"""The warp-specialized Gluon matmul gives the Triton kernel's bits; the dispatch uses it.

Bitwise (``assert_same_bits``: shape, dtype and raw bytes) on an sm_90 GPU: ``gluon_matmul_cuda`` == the Triton kernel (a table
config keeps the dispatch out) for leaves 1/2/4/8, rounded and fp32, bf16 and fp16, ragged M
and N, and x / w given as transposes of row-major tensors (the backward's layouts);
``matmul_cuda`` runs the Gluon kernel from :data:`GLUON_MIN_ROWS` rows (checked with a spy) and
the Triton kernel below, and rows alone (Triton) == the same rows in a large batch (Gluon).
Negative control: cuBLAS gives other bits on the same inputs.  Skips without an sm_90 GPU.
"""
from __future__ import annotations

import pytest
import torch
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")
DEV = "cuda"


def gm():
    from tpinv.kernels import gluon_matmul
    return gluon_matmul


def tm():
    from tpinv.kernels import matmul_route
    return matmul_route


def make(m, n, k, dtype=torch.bfloat16, seed=0, x_t=False, w_kn=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=dtype, generator=g) / k ** 0.5
    return (x.t().contiguous().t() if x_t else x), (w.t().contiguous().t() if w_kn else w)


def triton_only(x, w, leaves, out_dtype=None):
    from tpinv.kernels.tiles import launch_config
    fn = tm().matmul_partial_cuda if out_dtype == torch.float32 else tm().matmul_cuda
    return fn(x, w, leaves, config=launch_config(x.shape[0], leaves))


@pytest.mark.parametrize("leaves", [1, 2, 4, 8])
@pytest.mark.parametrize("m,n,k", [(4096, 1024, 2048), (1000, 200, 1024), (300, 3072, 1024), (70, 64, 512),
                                   (256, 640, 1024), (200, 9216, 512),    # 129-256 rows: 128x64, 128x128
                                   (256, 6144, 512)])                     # 128x(64+32)
def test_gluon_equals_the_triton_kernel(m, n, k, leaves):
    x, w = make(m, n, k)
    assert_same_bits(gm().gluon_matmul_cuda(x, w, leaves), triton_only(x, w, leaves),
                     'gm().gluon_matmul_cuda(x, w, leaves)')
    assert_same_bits(gm().gluon_matmul_cuda(x, w, leaves, torch.float32), triton_only(x, w, leaves, torch.float32),
                     'gm().gluon_matmul_cuda(x, w, leaves, torch.floa...')


def _table_tiles():
    from tpinv.kernels.tiles import GLUON_TABLE_TILES
    return [pytest.param(cfg, leaves, id=f"{cfg.name()}-L{leaves}") for cfg, leaves in GLUON_TABLE_TILES]


@pytest.mark.parametrize("cfg,leaves", _table_tiles())
@pytest.mark.parametrize("n", [328, 360, 640])   # last 96-wide tile: first part; second part; first whole
def test_every_table_tile_gives_the_same_bits(cfg, leaves, n):
    """Each tile the table may launch above 128 rows (two accumulators side by side included),
    at ragged M and N and in the backward's layouts, == the Triton kernel, rounded and fp32."""
    for x_t, w_kn in ((False, False), (True, False), (False, True)):
        x, w = make(264, n, 1024, x_t=x_t, w_kn=w_kn)
        ref = triton_only(x.contiguous(), w.contiguous(), leaves, torch.float32)
        got = gm().gluon_matmul_cuda(x, w, leaves, torch.float32, config=cfg)
        assert_same_bits(got, ref, f'gluon {cfg.name()} fp32 x_t={x_t} w_kn={w_kn}')
    x, w = make(264, n, 1024)
    assert_same_bits(gm().gluon_matmul_cuda(x, w, leaves, config=cfg), triton_only(x, w, leaves),
                     f'gluon {cfg.name()} rounded')


@pytest.mark.parametrize("cfg", [p.values[0] for p in _table_tiles() if p.values[1] == 8],
                         ids=lambda cfg: cfg.name())
def test_tree_staging_tile_shares_the_third_level_across_tiles(cfg):
    """Under an 8-leaf tree the epilogue's staging tile and the tree's third level are the same
    bytes: each CTA walks several tiles (a tile's store drains while the next one's leaves run
    and its leaf 3 writes the level), over short leaves (two k tiles each), through the TMA
    store: the Triton kernel's bits.  Control: the same product with leaves 0-3 (the sum the third
    level holds) zeroed in x gives other bits, so a level lost under the staging tile shows."""
    from tpinv.kernels.device import sm_count
    from tpinv.kernels.launch import cdiv
    m, n, k = 2048, 4096, 1024
    x, w = make(m, n, k)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.tile_n)
    assert tiles >= 3 * sm_count(x.device), tiles
    assert gm().uses_tma_store(x, w, 8, config=cfg)
    got = gm().gluon_matmul_cuda(x, w, 8, config=cfg)
    assert_same_bits(got, triton_only(x, w, 8), f"gluon {cfg.name()} 8 leaves, {tiles} tiles")
    first_half_lost = x.clone()
    first_half_lost[:, :k // 2] = 0
    assert_bits_differ(gm().gluon_matmul_cuda(first_half_lost, w, 8, config=cfg), got,
                       "control: the third level's leaves dropped")


@pytest.mark.parametrize("leaves", [1, 8])
@pytest.mark.parametrize("n", [1000, 1001, 1004])   # 16-byte aligned rows: TMA store; else registers
def test_both_epilogues_give_the_triton_kernels_bytes(leaves, n):
    """16-bit outputs whose rows are 16-byte aligned leave through shared memory and TMA, others
    (and fp32 outputs) from registers: the same single rounding either way, ragged N included."""
    x, w = make(1000, n, 1024)
    assert gm().uses_tma_store(x, w, leaves) == (n % 8 == 0)
    assert not gm().uses_tma_store(x, w, leaves, torch.float32)
    rounded, fp32 = gm().gluon_matmul_cuda(x, w, leaves), gm().gluon_matmul_cuda(x, w, leaves, torch.float32)
    assert_same_bits(rounded, triton_only(x, w, leaves), f"rounded, n={n}")
    assert_same_bits(fp32, triton_only(x, w, leaves, torch.float32), f"fp32, n={n}")
    assert_same_bits(rounded, fp32.to(x.dtype), f"one rounding of the fp32 result, n={n}")
    # control: another rounding of the same fp32 values (toward zero: the low 16 bits dropped)
    truncated = (fp32.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert_bits_differ(rounded, truncated, "control: truncation")


@pytest.mark.parametrize("x_t,w_kn", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("leaves", [1, 8])
@pytest.mark.parametrize("m", [1024, 256])
def test_transposed_operands_give_the_same_bits(x_t, w_kn, leaves, m):
    x, w = make(m, 768, 2048, x_t=x_t, w_kn=w_kn)
    assert gm().supported(x, w, leaves)
    ref = triton_only(x.contiguous(), w.contiguous(), leaves, torch.float32)
    assert_same_bits(gm().gluon_matmul_cuda(x, w, leaves, torch.float32), ref,
                     'gm().gluon_matmul_cuda(x, w, leaves, torch.floa...')
    assert_same_bits(tm().matmul_partial_cuda(x, w, leaves), ref, 'tm().matmul_partial_cuda(x, w, leaves)')


def test_fp16():
    x, w = make(512, 512, 1024, dtype=torch.float16)
    for leaves in (1, 8):
        assert_same_bits(gm().gluon_matmul_cuda(x, w, leaves), triton_only(x, w, leaves),
                         'gm().gluon_matmul_cuda(x, w, leaves)')


def test_dispatch_uses_gluon_from_the_row_threshold(monkeypatch):
    calls = []
    real = gm().launch_plan
    monkeypatch.setattr(gm(), "launch_plan", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    threshold = tm().GLUON_MIN_ROWS
    x, w = make(threshold + 300, 512, 1024)
    big = tm().matmul_cuda(x, w, 8)
    few = tm().matmul_cuda(x[:threshold - 1], w, 8)
    assert calls == [threshold + 300]                      # the batch ran Gluon, the few rows did not
    assert_same_bits(big, triton_only(x, w, 8), 'big')
    assert_same_bits(few, big[:threshold - 1], 'few')           # rows alone (Triton) == in the batch (Gluon)
    assert_same_bits(tm().matmul_cuda(x[:1], w, 8), big[:1], 'tm().matmul_cuda(x[:1], w, 8)')


def test_unsupported_inputs_are_named():
    x, w = make(256, 256, 512)
    assert "bf16 or fp16" in gm().unsupported_reason(x.float(), w.float(), 8, None)
    assert "leaves" in gm().unsupported_reason(x, w, 16, None)
    assert "row-major or column-major" in gm().unsupported_reason(x[:, ::2], w[:, ::2], 8, None)
    with pytest.raises(ValueError, match="gluon_matmul_cuda"):
        gm().gluon_matmul_cuda(x, w, 3)


def test_negative_control_cublas_differs():
    x, w = make(4096, 1024, 4096)
    assert_bits_differ(x @ w.T, gm().gluon_matmul_cuda(x, w, 8), 'x @ w.T')


@pytest.mark.parametrize("w_kn", [False, True])
@pytest.mark.parametrize("leaves", [2, 8])
def test_long_leaves_run_leaf_by_leaf_with_the_tree_kernels_bytes(monkeypatch, leaves, w_kn):
    """Leaves of LEAF_SPLIT_MIN_LEN or more run one one-leaf launch per leaf and the tree's top as
    fp32 adds (the route is asserted): the bytes of the tree kernels (Triton, Gluon), rounded and
    fp32.  Control: the leaf partials summed in a chain, not the tree, give other bytes."""
    n_leaf = tm().LEAF_SPLIT_MIN_LEN
    x, w = make(300, 640, leaves * n_leaf, seed=leaves, w_kn=w_kn)   # w_kn: the lm head's dX layout
    runs = []
    real = tm()._by_leaves
    monkeypatch.setattr(tm(), "_by_leaves", lambda *a: runs.append(a[2]) or real(*a))
    got = tm().matmul_cuda(x, w, leaves)
    got32 = tm().matmul_partial_cuda(x, w, leaves)
    assert runs == [leaves, leaves], "the product ran leaf by leaf"
    assert_same_bits(got, triton_only(x, w, leaves), "leaf by leaf == the Triton tree kernel")
    assert_same_bits(got, gm().gluon_matmul_cuda(x, w, leaves), "== the Gluon tree kernel")
    assert_same_bits(got32, triton_only(x, w, leaves, torch.float32), "fp32 partial")
    parts = [tm().matmul_partial_cuda(x[:, i * n_leaf:(i + 1) * n_leaf], w[:, i * n_leaf:(i + 1) * n_leaf], 1)
             for i in range(leaves)]
    chain = parts[0]
    for p in parts[1:]:
        chain = chain + p
    if leaves > 2:
        assert_bits_differ(chain, got32, "control: a chain over the leaves")
    short = tm().matmul_cuda(x[:, :leaves * 64].contiguous(), w[:, :leaves * 64].contiguous(), leaves)
    assert runs == [leaves, leaves] and short.shape == (300, 640), "short leaves keep the tree kernel"


def _ptxas_messages(ptx: str, tmp_path) -> str:
    import os
    import subprocess

    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip(f"no ptxas bundled with Triton at {ptxas}")
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    run = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "kernel.cubin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stderr


def _with_accumulator_written_in_flight(ptx: str) -> str:
    """``ptx`` with one accumulator register of its first wgmma zeroed right after that group is
    committed: a non-wgmma instruction defining an accumulator while the wgmma is in flight."""
    import re
    first = re.search(r"wgmma\.mma_async[^{]*\{(%r\d+),", ptx)
    end = ptx.index("\n", ptx.index("wgmma.commit_group.sync.aligned;", first.end()))
    return ptx[:end + 1] + f"\tmov.b32 \t{first.group(1)}, 0;\n" + ptx[end + 1:]


def test_table_tiles_keep_their_wgmmas_in_flight(tmp_path):
    """ptxas serializes every wgmma of a kernel (its message C7515) where a non-wgmma instruction
    writes an accumulator register while a wgmma is in flight: the bits stay right and the kernel
    runs at about half speed.  Every tile the table may launch, with either epilogue, compiles
    without the message.  Control: the same PTX with an accumulator zeroed in flight gets it."""
    from tpinv.kernels.tiles import GLUON_TABLE_TILES
    x, w = make(264, 640, 1024)
    for cfg, leaves in GLUON_TABLE_TILES:
        gm().gluon_matmul_cuda(x, w, leaves, config=cfg)                  # TMA-store epilogue
        gm().gluon_matmul_cuda(x, w, leaves, torch.float32, config=cfg)   # register epilogue
    from tpinv.kernels.gluon_matmul_kernel import _contract_mm_ws_kernel
    compiled = [k for entry in _contract_mm_ws_kernel.device_caches.values() for k in entry[0].values()]
    assert len(compiled) >= 2 * len(GLUON_TABLE_TILES)   # each tile, each epilogue
    for kernel in compiled:
        assert "C7515" not in _ptxas_messages(kernel.asm["ptx"], tmp_path), kernel.metadata
    assert "C7515" in _ptxas_messages(_with_accumulator_written_in_flight(compiled[0].asm["ptx"]), tmp_path)
