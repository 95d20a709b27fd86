"""The softmax family by leaves (one program per leaf) gives the row kernel's bytes.

Each check compares :func:`softmax_rows_by_leaves` with the one-program-per-row kernel
(``_fused`` given its table config, which always runs the row kernel) byte for byte: out, max
and sum, every mode, fp32/bf16/fp16, leaves 2/4/8, rows of NaN (of either sign), +-inf, all
-inf, a max of mixed +-0 and of -0 alone, subnormals, leaves with no element of clear sign
(negative, -0 alone, -inf, a negative NaN at the leaf's end), rows of positive elements only,
and launch shapes down to ``leaves`` programs looping over many rows -- both with the leaf
held in shared memory (the Gluon kernel, sm_90; asserted to run) and read through L2 (the Triton
kernel).  The public ops are asserted to take the by-leaves path.  Control: raising one element
of one leaf to a new row max changes that row's bytes (so the comparison sees a change in any
leaf).  Skips without CUDA.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tpinv.core.contract import DEFAULT_LEAVES
from tpinv.kernels.reference_softmax import logsumexp_from_parts
from tpinv.testing import assert_bits_differ, assert_same_bits
from tpinv.testing.special_values import special_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda"


def on_sm90() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(params=["held", "through_l2"])
def held_runs(request, monkeypatch):
    """Run the test with the leaf held in shared memory, then read through L2; yields the list
    the held launcher appends ``(rows shape, stagger_ns)`` to (the held path is asserted to run
    where it can)."""
    _, bl = mods()
    monkeypatch.setattr(bl, "HELD", [request.param == "held"])
    runs = []
    if request.param == "held":
        if not on_sm90():
            pytest.skip("the held-leaf kernel runs on sm_90 only")
        from tpinv.kernels import gluon_softmax
        real = gluon_softmax.softmax_rows_held

        def counted(rows, out, max_, total, leaves, mode, block, n_programs, num_warps, per_sm,
                    stagger_ns, lse=None):
            runs.append((rows.shape, stagger_ns))
            return real(rows, out, max_, total, leaves, mode, block, n_programs, num_warps, per_sm,
                        stagger_ns, lse)

        monkeypatch.setattr(gluon_softmax, "softmax_rows_held", counted)
    return runs


def table_holds(dtype, mode) -> bool:
    """Whether the held kernel's table runs ``dtype`` in ``mode`` (else the L2 kernel is faster)."""
    from tpinv.kernels import gluon_softmax_plan
    return gluon_softmax_plan.HELD_CONFIG[dtype, mode] is not None


def mods():
    from tpinv.kernels import triton_softmax, triton_softmax_leaves
    return triton_softmax, triton_softmax_leaves


def rand(*shape, dtype=torch.float32, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEV)


def row_kernel(ts, x, leaves, mode):
    return ts._fused(x, leaves, mode, ts._FUSED_CONFIG[x.dtype])


def check_same(got, want, what):
    for name, a, b in zip(("out", "max", "sum"), got, want):
        if b is None:
            assert a is None, what
        else:
            assert_same_bits(a, b, f"{what} {name}")


#: (leaves, width, rows, held on sm_90): Qwen3's and Llama 3's vocabularies (leaves of 5 and 4
#: steps of 4096, the last one partly past the leaf's end), one step of 2048 and of 4096, a
#: last step of whole tiles and none past them (6144 = 4096 + 2048), and leaves of 3001 (not
#: 16-aligned: through L2)
CASES = ((8, 151936, 37, True), (8, 128256, 9, True), (4, 4 * 2048, 5, True),
         (2, 2 * 3001, 300, False), (8, 8 * 4096, 1, True), (2, 2 * 6144, 7, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_same_bytes_as_the_row_kernel(dtype, held_runs):
    ts, bl = mods()
    for leaves, width, rows, held in CASES:
        x = special_rows(rand(max(rows, 9), width, dtype=dtype, seed=leaves + rows))[:rows]
        for mode in (ts._MODE_LOG, ts._MODE_SOFTMAX, ts._MODE_STATS):
            want = row_kernel(ts, x, leaves, mode)
            before = len(held_runs)
            got = bl.softmax_rows_by_leaves(x, leaves, mode)
            check_same(got, want, f"{dtype} leaves={leaves} width={width} rows={rows} mode={mode}")
            ran_held = len(held_runs) > before
            assert ran_held == (held and bl.HELD[0] and table_holds(dtype, mode)), (leaves, width, mode)
    # the table staggers the starts of 16-bit launches (scheduling only), not fp32's
    assert all((stagger > 0) == (dtype != torch.float32) for _, stagger in held_runs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_leaves_at_the_quotient_guard(dtype, held_runs):
    """Softmax's leaves whose least element sits about the line where the quotient from the row's
    reciprocal stops being exact (``reciprocal_divides_exactly``: ``(lo - shift) * log2(e)`` at
    least ``t - 96``, ``t`` the total's exponent; and where the exp would flush), on both sides
    of it: every leaf has the row kernel's bytes, whichever way its output is computed."""
    ts, bl = mods()
    log2e = 1.4426950408889634
    rows = []
    for k, spread in enumerate((96.0, 126.0)):            # the two guards, in log2 units
        for t in (0, 3, 11, 17):                          # the total's exponent, ~2**t
            for nudge in (-2.0, -0.5, -1e-3, 0.0, 1e-3, 0.5):
                gen = torch.Generator().manual_seed(int(1000 * (k + t + nudge)) % 2**31)
                row = -torch.rand(151936, generator=gen) - 30.0   # each exp about 1e-13
                row[torch.randperm(151936, generator=gen)[: 2 ** t]] = 0.0   # total about 2**t
                low = -(spread - (t if spread == 96.0 else 0) + nudge) / log2e
                leaf_len = 151936 // DEFAULT_LEAVES
                starts = torch.arange(DEFAULT_LEAVES) * leaf_len
                row[starts + torch.randint(0, leaf_len, (DEFAULT_LEAVES,), generator=gen)] = low
                rows.append(row)                           # each leaf's least element: low
    x = torch.stack(rows).to(dtype).to(DEV)
    want = row_kernel(ts, x, DEFAULT_LEAVES, ts._MODE_SOFTMAX)
    check_same(bl.softmax_rows_by_leaves(x, DEFAULT_LEAVES, ts._MODE_SOFTMAX), want,
               f"softmax {dtype} at the guard")
    assert len(held_runs) == (1 if bl.HELD[0] else 0)      # the held kernel ran where it can


def test_launch_shapes_do_not_move_bits(held_runs):
    ts, bl = mods()
    x = special_rows(rand(203, 151936, dtype=torch.bfloat16, seed=5))
    want = row_kernel(ts, x, DEFAULT_LEAVES, ts._MODE_LOG)
    want_stats = row_kernel(ts, x, DEFAULT_LEAVES, ts._MODE_STATS)
    want_softmax = row_kernel(ts, x, DEFAULT_LEAVES, ts._MODE_SOFTMAX)
    if bl.HELD[0]:
        # (warps, programs per SM, stagger_ns): staggered starts are scheduling only
        configs = ((4, 0.01, 0), (8, 1, 0), (4, 2, 1000), (8, 4, 0), (4, 8, 500), (4, 3, 0),
                   (4, 5, 4000))
        modes = ((ts._MODE_LOG, want), (ts._MODE_STATS, want_stats),
                 (ts._MODE_SOFTMAX, want_softmax))
        for held_config in configs:
            for mode, w in modes:
                got = bl.softmax_rows_by_leaves(x, DEFAULT_LEAVES, mode, held_config=held_config)
                check_same(got, w, f"held {held_config} mode={mode}")
        assert [stagger for _, stagger in held_runs] == [c[2] for c in configs for _ in modes]
        return
    for config in ((1024, 4, 0.01, 1), (8192, 8, 1, 2), (16384, 16, 4, 3), (2048, 4, 8, 1)):
        check_same(bl.softmax_rows_by_leaves(x, DEFAULT_LEAVES, ts._MODE_LOG, config), want, str(config))
        check_same(bl.softmax_rows_by_leaves(x, DEFAULT_LEAVES, ts._MODE_STATS, config), want_stats,
                   f"statistics {config}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_meeting_in_a_cluster_give_the_row_kernel_s_bytes(dtype, held_runs, monkeypatch):
    """Every mode with a row's leaves in one thread-block cluster (the table's choice widened to
    every dtype and mode), leaves 8/4/2, one cluster looping over every row and as many as fit:
    the row kernel's bytes; the clustered launch is asserted to run, and the table's choice is
    asserted to be what runs (every mode of bf16, fp16 and fp32 clustered)."""
    ts, bl = mods()
    if not bl.HELD[0]:
        pytest.skip("the cluster kernel holds its leaves in shared memory")
    from tpinv.kernels import gluon_softmax_cluster, gluon_softmax_plan
    clustered = []
    real = gluon_softmax_cluster.softmax_rows_clustered

    def counted(rows, *args):
        clustered.append(rows.shape)
        return real(rows, *args)

    monkeypatch.setattr(gluon_softmax_cluster, "softmax_rows_clustered", counted)
    for table_dtype, mode, want_cluster in ((torch.bfloat16, ts._MODE_SOFTMAX, True),
                                            (torch.bfloat16, ts._MODE_LOG, True),
                                            (torch.bfloat16, ts._MODE_STATS, True),
                                            (torch.float16, ts._MODE_STATS, True),
                                            (torch.float32, ts._MODE_STATS, True)):
        x = special_rows(rand(37, 151936, dtype=table_dtype, seed=31))
        before = len(clustered)
        check_same(bl.softmax_rows_by_leaves(x, DEFAULT_LEAVES, mode), row_kernel(ts, x, DEFAULT_LEAVES, mode),
                   f"table's choice, {table_dtype} mode={mode}")
        assert (len(clustered) > before) == want_cluster, (table_dtype, mode)
    # control: a (dtype, mode) the table leaves out meets by tickets; ``x`` is the loop's last
    # rows (fp32 statistics, still in the table: they cluster), ``x16`` the same rows in bf16
    with monkeypatch.context() as m:
        m.setattr(gluon_softmax_plan, "CLUSTERED", gluon_softmax_plan.CLUSTERED - {(torch.bfloat16, 0)})
        before = len(clustered)
        check_same(bl.softmax_rows_by_leaves(x, DEFAULT_LEAVES, ts._MODE_STATS),
                   row_kernel(ts, x, DEFAULT_LEAVES, ts._MODE_STATS), "cluster, float32 statistics")
        x16 = x.to(torch.bfloat16)
        check_same(bl.softmax_rows_by_leaves(x16, DEFAULT_LEAVES, ts._MODE_STATS),
                   row_kernel(ts, x16, DEFAULT_LEAVES, ts._MODE_STATS), "tickets, bf16 statistics")
        assert len(clustered) == before + 1   # the fp32 call clustered, the bf16 one did not
    monkeypatch.setattr(gluon_softmax_plan, "CLUSTERED",
                        frozenset((d, m) for d in (torch.float32, torch.bfloat16, torch.float16)
                                  for m in (0, 1, 2)))
    for leaves, width, rows, _ in CASES[:3] + CASES[4:]:
        x = special_rows(rand(max(rows, 5), width, dtype=dtype, seed=leaves + rows + 1))[:rows]
        for mode in (ts._MODE_LOG, ts._MODE_SOFTMAX, ts._MODE_STATS):
            want = row_kernel(ts, x, leaves, mode)
            warps, _, stagger = gluon_softmax_plan.HELD_CONFIG[dtype, mode]
            for per_sm in (0.01, None):               # one cluster for every row; as many as fit
                before = len(clustered)
                config = None if per_sm is None else (warps, per_sm, stagger)
                got = bl.softmax_rows_by_leaves(x, leaves, mode, held_config=config)
                check_same(got, want, f"cluster {dtype} leaves={leaves} width={width} mode={mode} {config}")
                assert len(clustered) == before + 1, (leaves, width, mode, config)


@pytest.mark.parametrize("clustered", [True, False])
def test_a_leaf_read_partly_from_memory_gives_the_row_kernel_s_bytes(clustered, held_runs,
                                                                    monkeypatch):
    """fp32 Qwen3 leaves at three programs an SM hold 4 of their 5 steps and 4 of the last
    step's 6 tiles in shared memory and read the other 560 elements from memory in every pass
    (the table's shape for fp32 log_softmax and softmax): the row kernel's bytes in every mode,
    in a cluster and with tickets, NaN, infinities and -inf rows included.  Controls: at two
    programs an SM the whole leaf is held; raising the last element of a leaf (one read from
    memory, not held) to a new row max moves that row's bytes and no other row's."""
    ts, bl = mods()
    if not bl.HELD[0]:
        pytest.skip("only the held kernel holds a leaf")
    from tpinv.kernels import gluon_softmax_plan
    from tpinv.kernels.triton_softmax import leaf_block
    if not clustered:
        monkeypatch.setattr(gluon_softmax_plan, "CLUSTERED", frozenset())
    leaf_len = 151936 // DEFAULT_LEAVES
    options = functools.partial(gluon_softmax_plan.held_launch_options, 4, leaf_len,
                                DEFAULT_LEAVES, 1, leaf_block(leaf_len), 4)
    assert (options(3, 0)["HELD"], options(3, 0)["LIVE"]) == (4, 6)
    assert options(2, 0)["HELD"] == options(2, 0)["LIVE"] == 6        # control: all held
    x = special_rows(rand(41, 151936, seed=43))
    for mode in (ts._MODE_STATS, ts._MODE_LOG, ts._MODE_SOFTMAX):
        before = len(held_runs)
        got = bl.softmax_rows_by_leaves(x, DEFAULT_LEAVES, mode, held_config=(4, 3, 0))
        check_same(got, row_kernel(ts, x, DEFAULT_LEAVES, mode),
                   f"fp32 mode={mode} clustered={clustered}, leaf partly in memory")
        assert len(held_runs) == before + 1, mode
    before = bl.softmax_rows_by_leaves(x, DEFAULT_LEAVES, ts._MODE_LOG, held_config=(4, 3, 0))
    y = x.clone()
    y[30, 7 * leaf_len - 1] = x[30].max() + 1.0       # leaf 6's last element, read from memory
    after = bl.softmax_rows_by_leaves(y, DEFAULT_LEAVES, ts._MODE_LOG, held_config=(4, 3, 0))
    others = [r for r in range(x.shape[0]) if r != 30]
    for a, b in zip(after, before):
        assert_same_bits(a[others], b[others], "other rows")
        assert_bits_differ(a[30], b[30], "the row whose memory-read element changed")


def test_a_misaligned_row_stride_reads_through_l2(held_runs):
    """A row stride that is not a multiple of 16 elements cannot be copied in 16-byte pieces:
    the L2 kernel runs it, with the same bytes."""
    ts, bl = mods()
    wide = rand(6, 151936 + 8, seed=21)
    x = wide[:, :151936]
    want = row_kernel(ts, x, DEFAULT_LEAVES, ts._MODE_LOG)
    check_same(bl.softmax_rows_by_leaves(x, DEFAULT_LEAVES, ts._MODE_LOG), want, "stride 151944")
    assert held_runs == []


def test_public_ops_take_the_by_leaves_path(monkeypatch):
    ts, bl = mods()
    calls = []
    real = bl.softmax_rows_by_leaves

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(bl, "softmax_rows_by_leaves", counted)
    x = rand(3, 16, 151936, dtype=torch.bfloat16, seed=9)
    flat = x.reshape(-1, x.shape[-1])
    got = ts.log_softmax_forward_cuda(x, DEFAULT_LEAVES)
    assert calls == [flat.shape]
    assert_same_bits(got.reshape(flat.shape), row_kernel(ts, flat, DEFAULT_LEAVES, ts._MODE_LOG)[0],
                     "log_softmax_forward_cuda")
    ts.softmax_forward_cuda(x, DEFAULT_LEAVES)
    m, total = ts.max_and_sum_exp_cuda(x, DEFAULT_LEAVES)
    assert len(calls) == 3
    _, want_m, want_total = row_kernel(ts, flat, DEFAULT_LEAVES, ts._MODE_STATS)
    assert_same_bits(m.reshape(-1), want_m, "max_and_sum_exp_cuda max")
    assert_same_bits(total.reshape(-1), want_total, "max_and_sum_exp_cuda sum")
    ts.logsumexp_forward_cuda(x, DEFAULT_LEAVES)
    assert len(calls) == 4
    ts.log_softmax_forward_cuda(rand(4, 8 * 1024), DEFAULT_LEAVES)      # leaves under MIN_LEAF_LEN
    assert len(calls) == 4
    monkeypatch.setattr(bl, "BY_LEAVES", [False])
    ts.log_softmax_forward_cuda(x, DEFAULT_LEAVES)
    assert len(calls) == 4


def test_control_a_change_in_one_leaf_moves_its_row(held_runs):
    ts, bl = mods()
    x = rand(4, 151936, seed=11)
    before = bl.softmax_rows_by_leaves(x, DEFAULT_LEAVES, ts._MODE_LOG)
    y = x.clone()
    y[2, 6 * (151936 // 8) + 17] = x[2].max() + 1.0      # leaf 6 holds the new row max
    after = bl.softmax_rows_by_leaves(y, DEFAULT_LEAVES, ts._MODE_LOG)
    for a, b in zip(after, before):
        assert_same_bits(a[[0, 1, 3]], b[[0, 1, 3]], "other rows")
        assert_bits_differ(a[2], b[2], "the changed row")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logsumexp_takes_its_tail_in_the_held_launches(dtype, held_runs, monkeypatch):
    """The public logsumexp: where the held kernel runs, its own launches write each row's
    ``safe_shift(max) + log(total)`` rounded once to the input's dtype (asserted to run there:
    the cluster kernel itself, whose program 0 of a row's cluster takes the row's total, for the
    (dtype, statistics) the plan's ``CLUSTERED`` names; the ticket kernel's combine launch
    elsewhere), with the bytes of :func:`logsumexp_from_parts` on
    the row kernel's max and total (and on ``max_and_sum_exp``'s), NaN, infinities and -inf rows
    included, leaves of 8 and 4.  Control: a new max in one row moves that row's logsumexp and
    no other row's."""
    ts, bl = mods()
    tails = []
    if bl.HELD[0]:
        from tpinv.kernels import gluon_softmax, gluon_softmax_cluster
        real_combine = gluon_softmax.combine_sums
        real_options = gluon_softmax_cluster.held_launch_options

        def combine(slots, max_, total, leaves, lse):
            tails.append(("combine", lse is not None))
            return real_combine(slots, max_, total, leaves, lse)

        def cluster_options(*args):
            options = real_options(*args)
            if options["MODE"] == 0:
                tails.append(("cluster", options["LSE"]))
            return options

        monkeypatch.setattr(gluon_softmax, "combine_sums", combine)
        monkeypatch.setattr(gluon_softmax_cluster, "held_launch_options", cluster_options)
    from tpinv.kernels import gluon_softmax_plan
    where = "cluster" if (dtype, ts._MODE_STATS) in gluon_softmax_plan.CLUSTERED else "combine"
    expected = []
    for leaves in (8, 4):      # an fp32 leaf of 37,984 elements is not held: the L2 kernel
        flat = special_rows(rand(26, 151936, dtype=dtype, seed=50 + leaves))
        x = flat.reshape(2, 13, 151936)
        before = len(held_runs)
        got = ts.logsumexp_forward_cuda(x, leaves)
        if len(held_runs) > before:
            expected.append((where, True))
        assert got.shape == (2, 13) and got.dtype == dtype
        _, m, s = row_kernel(ts, flat, leaves, ts._MODE_STATS)
        assert_same_bits(got.reshape(-1), logsumexp_from_parts(m, s).to(dtype),
                         f"{dtype} leaves={leaves}: logsumexp")
        before = len(held_runs)
        m, s = ts.max_and_sum_exp_cuda(x, leaves)
        if len(held_runs) > before:
            expected.append((where, False))
        assert_same_bits(got, logsumexp_from_parts(m, s).to(dtype), f"{dtype} leaves={leaves}")
    # each held logsumexp launch took its tail in its own launches; max_and_sum_exp did not
    assert tails == expected, (tails, expected)
    assert ((where, True) in tails) == bool(bl.HELD[0]), "the held kernel runs Qwen3's leaves of 8"
    y = flat.clone()
    # a new element 20 above row 9's max: the row's logsumexp, at most max + log(151936) (11.93)
    # before, is at least max + 20 after, a change no rounding to 16 bits can hide
    y[9, 3 * (151936 // 4) + 5] = flat[9].float().max() + 20.0
    after = ts.logsumexp_forward_cuda(y, 4)
    before = ts.logsumexp_forward_cuda(flat, 4)
    others = [r for r in range(flat.shape[0]) if r != 9]
    assert_same_bits(after[others], before[others], "other rows")
    assert_bits_differ(after[9], before[9], "the row with a new max")


def test_replayed_from_a_cuda_graph(held_runs):
    """Captured once, replayed on new values: the tickets and row counters are zeroed inside the
    graph, so every replay gives the eager call's bytes."""
    ts, bl = mods()
    static = rand(16, 151936, seed=13)
    assert bl.runs_by_leaves(static, DEFAULT_LEAVES, ts._MODE_LOG)
    ts.log_softmax_forward_cuda(static, DEFAULT_LEAVES)     # compile outside the capture
    ts.logsumexp_forward_cuda(static, DEFAULT_LEAVES)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ts.log_softmax_forward_cuda(static, DEFAULT_LEAVES)
        lse = ts.logsumexp_forward_cuda(static, DEFAULT_LEAVES)
    for seed in (14, 15):
        y = rand(16, 151936, seed=seed)
        static.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bits(out, row_kernel(ts, y, DEFAULT_LEAVES, ts._MODE_LOG)[0], f"replay {seed} log_softmax")
        _, m, s = row_kernel(ts, y, DEFAULT_LEAVES, ts._MODE_STATS)
        assert_same_bits(lse, logsumexp_from_parts(m, s).to(y.dtype), f"replay {seed} logsumexp")
