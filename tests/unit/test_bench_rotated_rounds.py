"""benchmarks.common.rotated_rounds: timers side by side, the order moved one place a round.

The matmul benchmarks time cuBLAS beside the contract this way and compare medians.  Here a fake
card makes the first reading after set-up fast by construction (as an idle GPU's clock does), and
the medians of rotated rounds come back unbiased; control: one reading in a fixed order hands the
fast slot to the first timer, so its ratio moves.  bench_matmul's table is printed from records of
the form ``bench_shape`` writes, so a formatting error cannot end a GPU run after its timings."""
import statistics

import pytest

from benchmarks.common import rotated_rounds


class FastFirstSlotCard:
    """Every kernel takes its own time, except the first one timed after set-up: 10% faster."""

    def __init__(self, times):
        self.times = times
        self.calls = []

    def timer(self, name):
        def run():
            self.calls.append(name)
            fast = len(self.calls) == 1
            return self.times[name] * (0.9 if fast else 1.0)
        return run


def medians(readings):
    return {name: statistics.median(v) for name, v in readings.items()}


def test_each_timer_takes_each_slot_once_in_as_many_rounds():
    card = FastFirstSlotCard({"cublas": 1.0, "leaves1": 1.0, "leaves8": 1.0})
    readings = rotated_rounds({n: card.timer(n) for n in ("cublas", "leaves1", "leaves8")}, 3)
    assert card.calls == ["cublas", "leaves1", "leaves8",
                          "leaves1", "leaves8", "cublas",
                          "leaves8", "cublas", "leaves1"]
    assert [len(v) for v in readings.values()] == [3, 3, 3]
    assert readings["cublas"] == [0.9, 1.0, 1.0]   # the round's readings, in round order


def test_medians_of_rotated_rounds_are_unbiased_and_one_fixed_reading_is_not():
    times = {"cublas": 260.0, "ours": 286.0}
    card = FastFirstSlotCard(times)
    med = medians(rotated_rounds({n: card.timer(n) for n in times}, 3))
    assert med == times
    assert med["cublas"] / med["ours"] == pytest.approx(260 / 286)
    # control: one reading each, cuBLAS first, the way a fixed order reads a ratio
    card = FastFirstSlotCard(times)
    once = rotated_rounds({n: card.timer(n) for n in times}, 1)
    assert once["cublas"] == [234.0] and once["ours"] == [286.0]
    assert once["cublas"][0] / once["ours"][0] != pytest.approx(260 / 286)


@pytest.mark.parametrize("rounds", [0, -1, 1.5, None])
def test_rounds_must_be_a_positive_int(rounds):
    with pytest.raises(ValueError, match="rounds must be a positive int"):
        rotated_rounds({"a": lambda: 1.0}, rounds)


def test_no_timers_is_an_error():
    with pytest.raises(ValueError, match="at least one timer"):
        rotated_rounds({}, 3)


def test_bench_matmul_prints_its_table_from_rotated_records(capsys):
    bench = pytest.importorskip("benchmarks.bench_matmul")

    def leaf(us, ratio, target):
        return {"config": "gluon 128x256w8s3", "us": us, "us_rounds": [us, us, us], "eager_us": us,
                "tflops": 700.0, "ratio": ratio, "target": target}
    rec = {"shape": "qkv", "M": 4096, "N": 6144, "K": 4096, "input_sets": 2, "rounds": 3,
           "flop_floor_us": 259.4, "byte_floor_us": 44.1, "cublas_us": 290.4,
           "cublas_us_rounds": [259.5, 294.3, 290.4], "cublas_tflops": 710.0,
           "leaves1": leaf(292.9, 0.991, 0.9), "leaves8": leaf(336.4, 0.799, 0.85)}
    bench.print_table([rec], "a card")
    out = capsys.readouterr().out
    assert "median of 3 rotated rounds" in out
    row = next(line for line in out.splitlines() if line.startswith("qkv"))
    assert "0.991 ok" in row and "0.799 MISS -0.051" in row


def _fake_card(monkeypatch, bench):
    """bench_matmul's device pieces replaced: inputs on the CPU, a timer whose reading is the op's
    slot number in the whole run (so medians and rounds can be told apart), kernels as x @ w.T."""
    import torch
    real_randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **k: real_randn(*a, **k))
    slots = iter(range(10_000))
    monkeypatch.setattr(bench, "graph_time_us", lambda op, sets, est: (op(0), 100.0 + next(slots))[1])
    monkeypatch.setattr(bench, "matmul_cuda", lambda x, w, leaves, **k: x @ w.T)
    monkeypatch.setattr(bench, "launch_contract", lambda x, w, leaves, dtype, cfg: x @ w.T)
    monkeypatch.setattr(bench, "do_bench", lambda fn, **k: (fn(), 0.5)[1])
    monkeypatch.setattr(bench, "kernel_name", lambda x, w, leaves: "fake kernel")


def test_bench_shape_records_medians_of_rotated_rounds(monkeypatch):
    bench = pytest.importorskip("benchmarks.bench_matmul")
    _fake_card(monkeypatch, bench)
    rec = bench.bench_shape("qkv", 64, 96, 128, 1e15, 3e12, 50 << 20, False, 3)
    # slots: round 1 cublas 100, leaves1 101, leaves8 102; round 2 leaves1 103, leaves8 104,
    # cublas 105; round 3 leaves8 106, cublas 107, leaves1 108
    assert rec["cublas_us_rounds"] == [100.0, 105.0, 107.0] and rec["cublas_us"] == 105.0
    assert rec["leaves1"]["us_rounds"] == [101.0, 103.0, 108.0] and rec["leaves1"]["us"] == 103.0
    assert rec["leaves8"]["us"] == 104.0
    assert rec["leaves8"]["ratio"] == pytest.approx(105.0 / 104.0)
    swept = bench.bench_shape("qkv", 64, 96, 128, 1e15, 3e12, 50 << 20, True, 1)
    assert set(swept["leaves8"]["sweep_us"]) == {c.name() for c in bench.sweep_configs(8)}
    assert swept["leaves8"]["best_config"] in swept["leaves8"]["sweep_us"]


def test_check_gluon_matmul_times_its_cases_in_rotated_rounds(monkeypatch):
    check = pytest.importorskip("benchmarks.check_gluon_matmul")
    import torch
    _fake_card(monkeypatch, check.bm)
    monkeypatch.setattr(check, "make", lambda m, n, k, dtype, seed=0, **kw: (torch.ones(m, k), torch.ones(n, k)))
    monkeypatch.setattr(check, "triton_mm", lambda x, w, leaves, out_dtype=None: x @ w.T)
    monkeypatch.setattr(check, "table_config", lambda x, w, leaves: "table config")
    monkeypatch.setattr(check, "gluon_matmul_cuda", lambda x, w, leaves, out_dtype=None, config=None: x @ w.T)
    rec = check.time_case("qkv", 64, 96, 128, 8, None, 50 << 20, rounds=3)
    assert [rec[k]["us_rounds"] for k in ("cublas", "triton", "gluon")] == [
        [100.0, 105.0, 107.0], [101.0, 103.0, 108.0], [102.0, 104.0, 106.0]]
    assert rec["gluon"]["ratio_to_cublas"] == pytest.approx(105.0 / 104.0)

    def broken(op, sets, est):
        raise RuntimeError("no such kernel")
    monkeypatch.setattr(check.bm, "graph_time_us", broken)
    rec = check.time_case("qkv", 64, 96, 128, 8, None, 50 << 20, rounds=2)
    assert rec["gluon"] == {"error": "RuntimeError: no such kernel"}
