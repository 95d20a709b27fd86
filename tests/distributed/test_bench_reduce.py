"""``python -m benchmarks.bench_reduce`` on gloo ranks: it runs, and every tree algorithm it times
gives the one-process tree's bits (the benchmark's own check, on CPU at 2 and 4 ranks).  A smoke
test of the benchmark; the reducer's invariance and its negative controls are in
``test_reduce.py``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("world", [2, 4])
def test_bench_reduce_runs_and_every_tree_row_is_the_tree(tmp_path, world):
    out = tmp_path / "reduce.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_reduce", "--world", str(world),
                           "--backend", "gloo", "--sizes", "4K,64K", "--warmup", "0", "--iters", "1",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    trees = [r for r in records if r["algorithm"] != "all_reduce"]
    assert {r["bytes"] for r in trees} == {4096, 65536} and all(r["world"] == world for r in trees)
    assert any(r["algorithm"].startswith("auto(") for r in trees)
    assert all(r["bitwise_equal_tree"] for r in trees), [r for r in trees if not r["bitwise_equal_tree"]]
