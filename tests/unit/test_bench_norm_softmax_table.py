"""benchmarks.bench_norm_softmax prints its table and refuses bad arguments without a GPU.

The timing itself runs on a GPU (tools/gpu_run.sh); here the table is made from records of the
form ``run_norm`` and ``run_softmax`` write, so a formatting error cannot end a GPU run after its
timings.  Control: a record whose bytes differ is marked in the table, not printed as a match."""
import subprocess
import sys

from benchmarks import bench_norm_softmax as bench

NORM = dict(op="rms_norm", dtype="bf16", T=4096, H=1024, heads=1, ms=0.01, gbps=2000.0,
            frac_copy=0.6, torch_ms=0.02, torch_gbps=1000.0, bwd_ms=0.02, bwd_gbps=1500.0,
            bwd_frac_copy=0.45)
SOFTMAX = dict(op="softmax", dtype="fp16", T=1024, V=bench.VOCAB, ms=0.15, gbps=3400.0,
               frac_copy=0.7954, same_bytes=True, graph_ms=0.14, graph_frac_copy=0.8512,
               torch_ms=0.2, torch_gbps=2500.0, row_kernel_ms=0.3, row_kernel_frac_copy=0.41,
               l2_ms=0.2, l2_frac_copy=0.6)


def test_the_table_has_a_row_a_record_with_its_check():
    text = bench.table([NORM, SOFTMAX, dict(SOFTMAX, op="logsumexp", same_bytes=False)], 4270.0)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| op "))
    rows = [line for line in lines if line.startswith("| ") and line is not header and "---" not in line]
    assert len(rows) == 3 and all(row.count("|") == header.count("|") for row in rows)
    assert "| 79.5% | 85.1% | yes |" in rows[1]
    assert "**NO**" in rows[2] and "yes" not in rows[2]
    assert "| 60.0% | - | - |" in rows[0]


def test_an_unknown_dtype_is_refused_before_any_device_work():
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_norm_softmax", "--softmax-dtypes",
                          "bf16,fp8"], capture_output=True, text=True)
    assert run.returncode == 2 and "unknown ['fp8']" in run.stderr
