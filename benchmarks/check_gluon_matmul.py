"""Check the Gluon contract matmul on an sm_90 GPU: same bits as the Triton kernel, and its speed.

1. Correctness (bitwise): ``gluon_matmul_cuda(x, w, L)`` == the Triton kernel
   (``matmul_cuda(x, w, L, config=<its table config>)``) and the fp32 variant ==
   ``matmul_partial_cuda``, bf16, Qwen3-8B shapes x M in (1, 17, 32, 256, 1000, 4096) x leaves
   in (1, 2, 4, 8), fp16 on o_proj, and x and/or w given as transposes of row-major tensors
   (the layouts of the backward).  Negative control: cuBLAS (``x @ w.T``) differs from the
   contract at leaves=8 on at least one shape.
2. Timing (CUDA-graph replays, helpers of benchmarks/bench_matmul.py): cuBLAS, the Triton kernel
   (table config) and the Gluon kernel, leaves 1 and 8, M in (256, 4096) and 8192^3.
3. ``--sweep``: a few other Gluon launch shapes at M=4096 and M=256 (bits checked, then timed);
   ``--sweep-only`` runs just that, on all four shapes (``--sweep-rows 256``: those M only).

Every timing case times its kernels side by side in ``--rounds`` rotated rounds and reports each
one's median (:func:`benchmarks.common.rotated_rounds`, as bench_matmul does).

Every case runs in its own try/except and prints a line before it starts (a per-case watchdog
dumps the stack and exits if one hangs); ``--budget`` seconds after the start no new case
begins, and the JSON is rewritten after every case.

    python -m benchmarks.check_gluon_matmul [--json out.json] [--sweep | --sweep-only] [--budget 250] [--rounds 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import json
import statistics
import time
import traceback

import torch

import triton

from benchmarks import bench_matmul as bm  # timing helpers and shapes
from benchmarks.common import rotated_rounds
from tpinv.kernels import tiles
from tpinv.kernels.gluon_matmul import gluon_matmul_cuda, table_config
from tpinv.kernels.tiles import GluonConfig
from tpinv.kernels.matmul_route import matmul_cuda, matmul_partial_cuda


def triton_mm(x, w, leaves, out_dtype=None):
    """The Triton kernel alone (a table config keeps the Gluon dispatch out)."""
    fn = matmul_partial_cuda if out_dtype == torch.float32 else matmul_cuda
    return fn(x, w, leaves, config=tiles.launch_config(x.shape[0], leaves))

CHECK_MS = (4096, 256, 1000, 32, 17, 1)
LEAVES = (1, 2, 4, 8)
TIME_MS = (256, 4096)
#: (M, leaves) -> other Gluon launch shapes to time with --sweep (bits checked first); stages at
#: most what fits beside the epilogue's staging tile (tiles.check_gluon_config)
SWEEP = {(4096, 1): (GluonConfig(128, 256, 8, 3), GluonConfig(128, 256, 8, 3, group_m=4),
                     GluonConfig(128, 256, 8, 3, group_m=16), GluonConfig(128, 128, 8, 6)),
         (4096, 8): (GluonConfig(128, 128, 8, 5), GluonConfig(128, 128, 8, 4), GluonConfig(128, 128, 8, 3),
                     GluonConfig(128, 64, 8, 8)),
         (256, 1): (GluonConfig(128, 128, 8, 6), GluonConfig(128, 64, 8, 8), GluonConfig(128, 256, 8, 3),
                    GluonConfig(128, 64, 8, 6, block_n2=32), GluonConfig(128, 64, 8, 7, block_n2=32),
                    GluonConfig(128, 128, 8, 3, block_n2=64), GluonConfig(128, 128, 8, 4, block_n2=64),
                    GluonConfig(128, 128, 8, 4, block_n2=64, group_m=4)),
         (256, 8): (GluonConfig(128, 128, 8, 5), GluonConfig(128, 128, 8, 4), GluonConfig(128, 64, 8, 8),
                    GluonConfig(128, 64, 8, 7), GluonConfig(128, 64, 8, 6, block_n2=32),
                    GluonConfig(128, 64, 8, 5, block_n2=32),
                    # one warpgroup a tile: qkv's 6,144 columns in 256 tiles of 64x96
                    GluonConfig(64, 64, 4, 8, block_n2=32), GluonConfig(64, 64, 4, 10, block_n2=32))}
CASE_TIMEOUT_S = 150


class Runner:
    """Runs cases under a deadline and a hang watchdog; records every outcome."""

    def __init__(self, args):
        self.t0 = time.time()
        self.args = args
        self.payload = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                        "torch": torch.__version__, "triton": triton.__version__,
                        "correctness": [], "timing": [], "sweep": [], "skipped": []}

    def write(self):
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(self.payload, f, indent=1)

    def run(self, section, label, fn):
        elapsed = time.time() - self.t0
        if elapsed > self.args.budget:
            self.payload["skipped"].append(label)
            return None
        print(f"[{elapsed:6.1f}s] {label} ...", flush=True)
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        try:
            rec = fn()
        except Exception as exc:  # report and go on
            rec = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            traceback.print_exc()
        finally:
            faulthandler.cancel_dump_traceback_later()
        rec = dict(rec, case=label)
        self.payload[section].append(rec)
        print(f"    -> {json.dumps({k: v for k, v in rec.items() if k != 'case'})}", flush=True)
        self.write()
        return rec


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Bitwise verdict; on a mismatch, how many elements differ and by how much."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return {"equal": False, "why": f"{got.shape}/{got.dtype} vs {ref.shape}/{ref.dtype}"}
    if torch.equal(got, ref):
        return {"equal": True}
    g, r = got.float(), ref.float()
    diff = (g - r).abs()
    both_nan = torch.isnan(g) & torch.isnan(r)
    bad = (g != r) & ~both_nan
    finite = diff[bad & ~torch.isnan(diff)]
    return {"equal": False, "mismatches": int(bad.sum()), "numel": got.numel(),
            "max_abs_diff": float(finite.max()) if finite.numel() else None,
            "nan_got": int(torch.isnan(g).sum()), "nan_ref": int(torch.isnan(r).sum())}


def make(m, n, k, dtype, seed=0, x_t=False, w_kn=False):
    """x [m, k], w [n, k]; ``x_t`` / ``w_kn``: stored as the transpose of a row-major tensor."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    return (x.t().contiguous().t() if x_t else x), (w.t().contiguous().t() if w_kn else w)


def check_case(name, m, n, k, leaves, dtype, x_t=False, w_kn=False):
    x, w = make(m, n, k, dtype, x_t=x_t, w_kn=w_kn)
    cfg = table_config(x, w, leaves)
    rounded = compare(gluon_matmul_cuda(x, w, leaves), triton_mm(x, w, leaves))
    partial = compare(gluon_matmul_cuda(x, w, leaves, torch.float32),
                      triton_mm(x, w, leaves, torch.float32))
    dispatched = compare(matmul_cuda(x, w, leaves), triton_mm(x, w, leaves))
    torch.cuda.synchronize()
    rec = {"shape": name, "M": m, "N": n, "K": k, "leaves": leaves, "dtype": str(dtype),
           "x_t": x_t, "w_kn": w_kn, "gluon_config": str(cfg), "rounded": rounded,
           "partial_fp32": partial, "dispatched": dispatched,
           "ok": rounded["equal"] and partial["equal"] and dispatched["equal"]}
    if not rec["ok"]:  # does the other way of starting a leaf's chain match?
        alt = dataclasses.replace(cfg, zero_acc=not cfg.zero_acc)
        rec[f"zero_acc={alt.zero_acc}"] = compare(
            gluon_matmul_cuda(x, w, leaves, torch.float32, config=alt),
            triton_mm(x, w, leaves, torch.float32))
    return rec


def control_case(name, m, n, k):
    x, w = make(m, n, k, torch.bfloat16)
    differs = not torch.equal(x @ w.T, triton_mm(x, w, 8))
    return {"shape": name, "M": m, "cublas_differs_from_leaves8": differs, "control": True}


def time_case(name, m, n, k, leaves, peak, l2_bytes, configs=None, rounds=3):
    set_bytes = 2 * (m * k + n * k)
    sets = max(1, min(8, -(-2 * l2_bytes // set_bytes)))
    xs = [make(m, n, k, torch.bfloat16, seed=s)[0] for s in range(sets)]
    ws = [make(m, n, k, torch.bfloat16, seed=100 + s)[1] for s in range(sets)]
    flops = 2 * m * n * k
    est = flops / 6e14 * 1e6
    rec = {"shape": name, "M": m, "N": n, "K": k, "leaves": leaves, "input_sets": sets,
           "target": bm.target(leaves, m)}

    ops = {"cublas": lambda i: torch.matmul(xs[i], ws[i].T)}
    if configs is None:
        rec["triton_config"] = tiles.launch_config(m, leaves).name()
        ops["triton"] = lambda i: triton_mm(xs[i], ws[i], leaves)
        rec["gluon_config"] = str(table_config(xs[0], ws[0], leaves))
        ops["gluon"] = lambda i: gluon_matmul_cuda(xs[i], ws[i], leaves)
    else:
        ref = triton_mm(xs[0], ws[0], leaves)
        for cfg in configs:
            key = f"gluon {cfg.name()}"
            try:
                rec[key + " bits"] = compare(
                    gluon_matmul_cuda(xs[0], ws[0], leaves, config=cfg), ref)
            except Exception as exc:
                rec[key + " bits"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
                continue
            ops[key] = lambda i, c=cfg: gluon_matmul_cuda(xs[i], ws[i], leaves, config=c)

    def timer(key, op):
        def run():
            try:
                return bm.graph_time_us(op, sets, est)
            except Exception as exc:  # recorded; the other timers go on
                rec[key] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
                traceback.print_exc()
                return float("nan")
        return run

    # side by side in rotated rounds, each time the median of its rounds (bench_matmul's method)
    readings = rotated_rounds({key: timer(key, op) for key, op in ops.items()}, rounds)
    for key, values in readings.items():
        if "error" not in rec.get(key, {}):
            us = statistics.median(values)
            rec[key] = {"us": us, "tflops": flops / us / 1e6, "us_rounds": values}
    base = rec["cublas"].get("us")
    for key, v in rec.items():
        if isinstance(v, dict) and "us" in v and base:
            v["ratio_to_cublas"] = base / v["us"]
    if peak:
        rec["cublas_pct_of_8192_peak"] = (flops / rec["cublas"]["us"] / 1e6) / (peak / 1e12) \
            if "us" in rec["cublas"] else None
    return rec


def print_summary(p):
    print("\n=== correctness (bitwise vs the Triton kernel) ===")
    checks = [r for r in p["correctness"] if not r.get("control")]
    bad = [r for r in checks if not r.get("ok")]
    n_ok = len(checks) - len(bad)
    print(f"{n_ok} cases identical, {len(bad)} not")
    for r in bad:
        detail = r.get("error") or {k: v for k, v in r.items()
                                    if k in ("rounded", "partial_fp32") or k.startswith("zero_acc")}
        print(f"  MISMATCH/ERROR {r['case']}: {detail}")
    ctrl = [r for r in p["correctness"] if "cublas_differs_from_leaves8" in r]
    print("\n=== timing: us per call (CUDA-graph replays), TFLOP/s, ratio to cuBLAS ===")
    print(f"{'shape':<10}{'M':>6}{'L':>3} | {'cuBLAS':>14} | {'triton':>22} | "
          f"{'gluon':>22} | target")
    for r in p["timing"]:
        if "error" in r:
            print(f"  {r['case']}: {r['error']}")
            continue

        def cell(key):
            v = r.get(key, {})
            if "us" not in v:
                return f"{'ERR':>22}" if key != "cublas" else f"{'ERR':>14}"
            ratio = f" {v['ratio_to_cublas']:.2f}x" if key != "cublas" else ""
            width = 22 if key != "cublas" else 14
            return f"{v['us']:.1f}us {v['tflops']:.0f}TF{ratio}".rjust(width)
        print(f"{r['shape']:<10}{r['M']:>6}{r['leaves']:>3} | {cell('cublas')} | "
              f"{cell('triton')} | {cell('gluon')} | {r['target']}")
    for r in p["sweep"]:
        print(f"{r['case']}: " + ", ".join(
            f"{k}: {v['us']:.1f}us {v.get('ratio_to_cublas', 0):.2f}x" if "us" in v else f"{k}: {v}"
            for k, v in r.items() if isinstance(v, dict)))
    if p["skipped"]:
        print(f"\nskipped for the time budget: {p['skipped']}")
    if ctrl:
        print(f"negative control (cuBLAS != leaves=8 on some shape): "
              f"{any(r.get('cublas_differs_from_leaves8') for r in ctrl)}")
    else:
        print("negative control: not run (only the sweep ran)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write all results to this path")
    ap.add_argument("--budget", type=float, default=250.0,
                    help="seconds after which no new case starts")
    ap.add_argument("--sweep", action="store_true", help="also time other Gluon launch shapes")
    ap.add_argument("--sweep-only", action="store_true",
                    help="only the sweep, on every Qwen3-8B shape (bits checked per config)")
    ap.add_argument("--sweep-rows", type=int, nargs="*", default=None,
                    help="sweep only these M (default: every M of the sweep table)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rotated rounds of every timing case; each time is their median")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("check_gluon_matmul needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    device = f"{props.name} ({props.multi_processor_count} SMs, sm_{props.major}{props.minor})"
    print(f"device {device}; torch {torch.__version__}; triton {triton.__version__}", flush=True)
    r = Runner(args)
    r.payload["device"] = device
    shapes = bm.QWEN3_8B
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    if args.sweep_only:
        for (m, leaves), configs in sorted(SWEEP.items()):     # M = 256 first
            if args.sweep_rows is not None and m not in args.sweep_rows:
                continue
            for name, n, k in shapes:
                r.run("sweep", f"sweep {name} M={m} leaves={leaves}",
                      lambda: time_case(name, m, n, k, leaves, None, l2, configs, rounds=args.rounds))
        r.payload["elapsed_s"] = time.time() - r.t0
        r.write()
        print_summary(r.payload)
        return
    # correctness: o_proj first (it compiles every variant the other shapes reuse)
    order = [shapes[1]] + [s for s in shapes if s is not shapes[1]]
    for i, (name, n, k) in enumerate(order):
        for m in CHECK_MS:
            for leaves in LEAVES:
                r.run("correctness", f"bits {name} M={m} leaves={leaves} bf16",
                      lambda: check_case(name, m, n, k, leaves, torch.bfloat16))
        if i == 0:
            for cname, cn, ck in shapes:
                r.run("correctness", f"control {cname} M=256",
                      lambda: control_case(cname, 256, cn, ck))
    # timing
    big = r.run("timing", "time 8192^3 leaves=1",
                lambda: time_case("8192^3", 8192, 8192, 8192, 1, None, l2, rounds=args.rounds))
    peak = None
    if big and "us" in big.get("cublas", {}):
        peak = 2 * 8192 ** 3 / (big["cublas"]["us"] * 1e-6)
        r.payload["cublas_8192_tflops"] = peak / 1e12
    r.run("timing", "time 8192^3 leaves=8",
          lambda: time_case("8192^3", 8192, 8192, 8192, 8, peak, l2, rounds=args.rounds))
    for m in TIME_MS[::-1]:
        for name, n, k in shapes:
            for leaves in (1, 8):
                r.run("timing", f"time {name} M={m} leaves={leaves}",
                      lambda: time_case(name, m, n, k, leaves, peak, l2, rounds=args.rounds))
    # fp16 on one shape (new compiles on both sides), and the backward's layouts
    name, n, k = shapes[1]
    for m in (4096, 1000, 256):
        for leaves in (1, 8):
            for x_t, w_kn in ((True, False), (False, True), (True, True)):
                r.run("correctness", f"bits {name} M={m} leaves={leaves} x_t={x_t} w_kn={w_kn}",
                      lambda: check_case(name, m, n, k, leaves, torch.bfloat16, x_t, w_kn))
    for m in (4096, 256, 17):
        for leaves in (1, 8):
            r.run("correctness", f"bits {name} M={m} leaves={leaves} fp16",
                  lambda: check_case(name, m, n, k, leaves, torch.float16))
    if args.sweep:
        for (m, leaves), configs in SWEEP.items():
            for name, n, k in (shapes[0], shapes[3]):
                r.run("sweep", f"sweep {name} M={m} leaves={leaves}",
                      lambda: time_case(name, m, n, k, leaves, peak, l2, configs, rounds=args.rounds))
    r.payload["elapsed_s"] = time.time() - r.t0
    r.write()
    print_summary(r.payload)
    ctrl = [x for x in r.payload["correctness"] if "cublas_differs_from_leaves8" in x]
    if ctrl:
        assert any(x["cublas_differs_from_leaves8"] for x in ctrl), \
            "negative control failed: cuBLAS equals the leaves=8 contract on every shape"


if __name__ == "__main__":
    main()
