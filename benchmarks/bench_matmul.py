"""Time the CUDA contract matmul against cuBLAS (``torch.matmul``, bf16) on Qwen3-8B shapes.

For each shape and M, prints the two floors (FLOP floor: 2MNK over the measured cuBLAS
8192^3 rate; byte floor: each input read once and the output written once, over the
measured device-to-device copy bandwidth), cuBLAS's time and TFLOP/s, and the contract
matmul's for leaves=1 and leaves=8 (the kernel ``matmul_cuda`` picks: the Gluon kernel from
65 rows on sm_90, else the Triton table config; named in the table) with its ratio to cuBLAS
and the target it is held to.  Each timing is a CUDA graph of many calls replayed under
``triton.testing.do_bench`` (median of replays, L2 cleared before each): the graph
removes Python launch cost (an eager ``do_bench`` time of the table config is kept in
the JSON), and the calls rotate over enough input sets to be twice the L2 size, so small
weights are not read from cache.  cuBLAS and the contract are timed side by side in
``--rounds`` rounds (default 3) whose order moves one place a round, and each time is the
median of its rounds (:func:`benchmarks.common.rotated_rounds`: the first kernel timed after
set-up reads fast on a GPU, so a fixed order would favour one side).  ``--sweep`` also times
every candidate launch config and reports the best.  Relative errors against an fp64 product
are reported per M.

    python -m benchmarks.bench_matmul [--sweep] [--rounds 3] [--json out.json] [--ms 32,256,1024,4096]
"""
from __future__ import annotations

import argparse
import datetime
import statistics

import torch
import triton
from triton.testing import do_bench

from benchmarks.common import copy_gbps, graph_time_us, rotated_rounds, write_json
from tpinv.kernels import tiles
from tpinv.kernels.matmul_route import gluon_kernel_for, matmul_cuda
from tpinv.kernels.triton_matmul import _contract_mm_kernel, launch_contract

#: Qwen3-8B linear layers (N, K) in nn.Linear layout.
QWEN3_8B = (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096),
            ("down_proj", 4096, 12288))
#: (leaves, smallest M, target ratio to cuBLAS)
TARGETS = {1: ((256, 0.90),), 8: ((4096, 0.85), (256, 0.80))}


def target(leaves: int, m: int) -> float | None:
    for m_min, ratio in TARGETS[leaves]:
        if m >= m_min:
            return ratio
    return None


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes read plus written per second by a large device-to-device copy."""
    return copy_gbps(nbytes, warmup=25, rep=200) * 1e9


def rel_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.double() @ w.double().T
    return ((out.double() - ref).norm() / ref.norm()).item()


def sweep_configs(leaves: int) -> list[tiles.MatmulConfig]:
    """Candidates worth timing: no split for one leaf; for a tree, only configs whose
    running + saved fp32 tiles fit in about 192 registers a thread (others spill)."""
    out = []
    for cfg in tiles.CANDIDATE_CONFIGS:
        if leaves == 1 and cfg.split > 1:
            continue
        per_cta = leaves // cfg.effective_split(leaves)
        regs_per_tile = cfg.block_m * cfg.block_n // (32 * cfg.num_warps)
        if regs_per_tile * per_cta.bit_length() > 192:
            continue
        out.append(cfg)
    return out


def bench_shape(name, m, n, k, peak_flops, copy_bw, l2_bytes, sweep, rounds=3):
    """cuBLAS, the contract at 1 and 8 leaves (and with ``sweep`` every candidate config) timed in
    ``rounds`` rotated rounds (:func:`benchmarks.common.rotated_rounds`); each time is the median of
    its rounds, each round's reading kept in the record."""
    set_bytes = 2 * (m * k + n * k)
    sets = max(1, min(8, -(-2 * l2_bytes // set_bytes)))
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(sets)]
    flops = 2 * m * n * k
    byte_floor = 2 * (m * k + n * k + m * n) / copy_bw * 1e6
    est = max(flops / 6e14 * 1e6, byte_floor)
    ops = {"cublas": lambda i: torch.matmul(xs[i], ws[i].T)}
    swept = {}   # leaves -> {config name: its key in ops}
    for leaves in (1, 8):
        ops[f"leaves{leaves}"] = lambda i, leaves=leaves: matmul_cuda(xs[i], ws[i], leaves)
        swept[leaves] = {}
        for c in sweep_configs(leaves) if sweep else ():
            swept[leaves][c.name()] = key = f"leaves{leaves} {c.name()}"
            ops[key] = lambda i, leaves=leaves, c=c: launch_contract(xs[i], ws[i], leaves, torch.bfloat16, c)
    readings = rotated_rounds({key: (lambda op=op: graph_time_us(op, sets, est)) for key, op in ops.items()},
                              rounds)
    med = {key: statistics.median(v) for key, v in readings.items()}
    rec = {"shape": name, "M": m, "N": n, "K": k, "input_sets": sets, "rounds": rounds,
           "flop_floor_us": flops / peak_flops * 1e6 if peak_flops else None,
           "byte_floor_us": byte_floor, "cublas_us": med["cublas"], "cublas_us_rounds": readings["cublas"],
           "cublas_tflops": flops / med["cublas"] / 1e6}
    for leaves in (1, 8):
        key = f"leaves{leaves}"
        us = med[key]
        eager = do_bench(lambda: matmul_cuda(xs[0], ws[0], leaves), warmup=10, rep=40,
                         return_mode="median") * 1e3
        r = {"config": kernel_name(xs[0], ws[0], leaves), "us": us, "us_rounds": readings[key],
             "eager_us": eager, "tflops": flops / us / 1e6, "ratio": med["cublas"] / us,
             "target": target(leaves, m)}
        if sweep:
            runs = {name: med[k_] for name, k_ in swept[leaves].items()}
            best = min(runs, key=runs.get)
            r["sweep_us"] = runs
            r["best_config"], r["best_us"] = best, runs[best]
            r["best_ratio"] = med["cublas"] / runs[best]
        rec[key] = r
    return rec


def kernel_name(x: torch.Tensor, w: torch.Tensor, leaves: int) -> str:
    """Which kernel ``matmul_cuda`` runs for this product, and its launch shape."""
    gluon = gluon_kernel_for(x, w, leaves, x.dtype)
    if gluon is not None:
        c = gluon.table_config(x, w, leaves)
        return f"gluon {c.name()}"
    return f"triton {tiles.launch_config(x.shape[0], leaves).name()}"


def accuracy(m: int) -> dict:
    n, k = 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    return {"M": m, "N": n, "K": k, "cublas": rel_err(torch.matmul(x, w.T), x, w),
            "leaves1": rel_err(matmul_cuda(x, w, 1), x, w),
            "leaves8": rel_err(matmul_cuda(x, w, 8), x, w)}


def _fmt_ratio(r):
    t = r["target"]
    if t is None:
        return f"{r['ratio']:.3f}"
    gap = r["ratio"] - t
    return f"{r['ratio']:.3f}{' ok' if gap >= 0 else f' MISS {gap:+.3f}'}"


def print_table(records, device):
    print(f"\ncontract matmul vs cuBLAS, bf16, {device}  (us per call: do_bench median of "
          f"CUDA-graph replays, then the median of {records[0]['rounds']} rotated rounds; "
          f"ratio = cuBLAS time / ours, then ok or MISS by how much against its target)")
    hdr = (f"{'shape':<10}{'M':>6}{'N':>7}{'K':>7}{'flop_fl':>9}{'byte_fl':>9}{'cuBLAS':>9}"
           f"{'TF/s':>6} | {'l=1 us':>8}{'TF/s':>6}{'ratio':>16} | {'l=8 us':>8}{'TF/s':>6}"
           f"{'ratio':>16} | {'kernel (or sweep best) l=1':>26} | {'l=8':>26}")
    print(hdr)
    print("-" * len(hdr))
    for r in records:
        l1, l8 = r["leaves1"], r["leaves8"]
        best1, best8 = (f"{r_['best_config']} {r_['best_ratio']:.2f}" if "best_config" in r_
                        else r_["config"] for r_ in (l1, l8))
        ff = f"{r['flop_floor_us']:.1f}" if r["flop_floor_us"] else "-"
        print(f"{r['shape']:<10}{r['M']:>6}{r['N']:>7}{r['K']:>7}{ff:>9}"
              f"{r['byte_floor_us']:>9.1f}{r['cublas_us']:>9.1f}{r['cublas_tflops']:>6.0f} | "
              f"{l1['us']:>8.1f}{l1['tflops']:>6.0f}{_fmt_ratio(l1):>16} | "
              f"{l8['us']:>8.1f}{l8['tflops']:>6.0f}{_fmt_ratio(l8):>16} | {best1:>26} | "
              f"{best8:>26}")


def kernel_resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled contract-matmul kernel."""
    out = []
    try:
        for caches in _contract_mm_kernel.device_caches.values():
            for key, kern in caches[0].items():
                out.append({"key": str(key)[-400:], "n_regs": kern.n_regs,
                            "n_spills": kern.n_spills, "shared": kern.metadata.shared})
    except Exception as exc:  # Triton-version specific: report, never fail the run
        out.append({"error": repr(exc)})
    return out


def _write(path, payload):
    if path:
        write_json(path, payload, quiet=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="32,256,1024,4096", help="comma-separated M values")
    p.add_argument("--sweep", action="store_true", help="also time every candidate config")
    p.add_argument("--rounds", type=int, default=3,
                   help="rotated rounds of cuBLAS beside the contract; each time is their median")
    p.add_argument("--json", default=None, help="write all numbers to this path")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("bench_matmul needs a CUDA device")
    ms = [int(v) for v in args.ms.split(",")]
    props = torch.cuda.get_device_properties(0)
    device = f"{props.name} ({props.multi_processor_count} SMs)"
    copy_bw = copy_bandwidth()
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    big = bench_shape("8192^3", 8192, 8192, 8192, None, copy_bw, l2, args.sweep, args.rounds)
    peak = 2 * 8192 ** 3 / (big["cublas_us"] * 1e-6)
    big["flop_floor_us"] = big["cublas_us"]
    print(f"device {device}; torch {torch.__version__}; triton {triton.__version__}")
    print(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s (read+write), cuBLAS bf16 8192^3 "
          f"{peak / 1e12:.0f} TFLOP/s", flush=True)
    records = []
    payload = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device,
               "torch": torch.__version__, "triton": triton.__version__, "copy_Bps": copy_bw,
               "peak_flops": peak, "records": records}
    for m in ms:
        for name, n, k in QWEN3_8B:
            records.append(bench_shape(name, m, n, k, peak, copy_bw, l2, args.sweep, args.rounds))
            print(f"  done {name} M={m}", flush=True)
            _write(args.json, payload)
    records.append(big)
    acc = [accuracy(m) for m in ms]
    print("\nrelative error vs fp64 (o_proj-sized, random bf16):")
    for a in acc:
        print(f"  M={a['M']:>5}: cuBLAS {a['cublas']:.3e}  leaves=1 {a['leaves1']:.3e}  "
              f"leaves=8 {a['leaves8']:.3e}")
    payload["accuracy"] = acc
    payload["kernels"] = kernel_resources()
    _write(args.json, payload)
    print_table(records, device)


if __name__ == "__main__":
    main()
