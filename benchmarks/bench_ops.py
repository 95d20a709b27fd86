#!/usr/bin/env python3
"""Time the invariant ops against what they replace: the CPU ops, or on a GPU the contract matmul.

On the CPU (the default without CUDA, or ``--cpu``) each invariant op is timed against the
PyTorch op it replaces, forward and forward+backward: the invariant ops build every
reduction from exact elementwise adds, so they cost a known factor over BLAS/ATen; this
prints that factor for model-sized shapes and writes JSON.  With a CUDA device it runs
``benchmarks/bench_matmul.py`` instead (TFLOP/s and the ratio to cuBLAS for the Qwen3-8B linear
shapes at M = 32, 256, 1024, 4096 and for 8192^3, leaves 1 and 8; arguments after ``--gpu-args``
go to it).

    python -m benchmarks.bench_ops [--cpu] [--threads 2] [--json runs/bench_ops.json] [--quick]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import host_median_s, write_json
from tpinv import ops
from tpinv.models.vanilla import plain_rms_norm, plain_rope


def fwd_bwd(fn, *inputs):
    def run():
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*xs)
        out.float().sum().backward()
    return run


def cases(quick):
    T, H, F_, V = (64, 256, 512, 1024) if quick else (256, 1024, 2816, 8192)
    B, Hq, Hkv, S, D = (1, 4, 2, 128, 32) if quick else (1, 8, 4, 512, 64)
    dt = torch.bfloat16
    x, w = torch.randn(T, H, dtype=dt), torch.randn(F_, H, dtype=dt) * 0.05
    nw = torch.ones(H, dtype=dt)
    logits = torch.randn(T, V)
    g, u = torch.randn(T, F_, dtype=dt), torch.randn(T, F_, dtype=dt)
    q = torch.randn(B, Hq, S, D, dtype=dt)
    k, v = torch.randn(B, Hkv, S, D, dtype=dt), torch.randn(B, Hkv, S, D, dtype=dt)
    pos = torch.arange(S).expand(B, S).contiguous()
    cos, sin = ops.rope_cos_sin(pos, D, 10000.0)
    ids, emb_w = torch.randint(0, V, (T,)), torch.randn(V, H, dtype=dt)

    def rope_ref(x):
        return plain_rope(x, cos, sin)

    def rms_ref(x, w):
        return plain_rms_norm(x, w, 1e-6)

    return [
        (f"matmul [{T}x{H}]@[{H}x{F_}]", lambda a, b: ops.matmul(a, b), lambda a, b: a @ b.t(), (x, w)),
        (f"rms_norm [{T}x{H}]", lambda a, b: ops.rms_norm(a, b, 1e-6), rms_ref, (x, nw)),
        (f"log_softmax [{T}x{V}]", lambda a: ops.log_softmax(a, 8), lambda a: F.log_softmax(a, -1), (logits,)),
        (f"silu_mul [{T}x{F_}]", ops.silu_mul, lambda a, b: F.silu(a) * b, (g, u)),
        (f"apply_rope [{B}x{Hq}x{S}x{D}]", lambda a: ops.apply_rope(a, cos, sin), rope_ref, (q,)),
        (f"attention causal GQA S={S} D={D}", lambda a, b, c: ops.attention(a, b, c, pos),
         lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True), (q, k, v)),
        (f"embedding [{T}] of [{V}x{H}]", lambda w_: ops.embedding(ids, w_), lambda w_: F.embedding(ids, w_), (emb_w,)),
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    p.add_argument("--json", default="runs/bench_ops.json")
    p.add_argument("--cpu", action="store_true", help="time the CPU ops even where CUDA is available")
    p.add_argument("--gpu-args", nargs=argparse.REMAINDER, default=[],
                   help="arguments for benchmarks/bench_matmul.py (GPU run)")
    a = p.parse_args(argv)
    if torch.cuda.is_available() and not a.cpu:
        from benchmarks.bench_matmul import main as bench_matmul
        bench_matmul(a.gpu_args)
        return
    torch.set_num_threads(a.threads)
    rows = []
    print(f"CPU, {a.threads} threads, bf16 inputs (fp32 logits), median of {a.repeat}")
    print(f"{'op':40s} {'torch ms':>9s} {'tpinv ms':>9s} {'x':>6s} {'torch f+b':>10s} {'tpinv f+b':>10s} {'x':>6s}")
    for name, mine, ref, inputs in cases(a.quick):
        with torch.no_grad():
            t_ref, t_mine = host_median_s(lambda: ref(*inputs), a.repeat), host_median_s(lambda: mine(*inputs), a.repeat)
        b_ref, b_mine = host_median_s(fwd_bwd(ref, *inputs), a.repeat), host_median_s(fwd_bwd(mine, *inputs), a.repeat)
        rows.append(dict(op=name, torch_ms=t_ref * 1e3, tpinv_ms=t_mine * 1e3, fwd_ratio=t_mine / t_ref,
                         torch_fwd_bwd_ms=b_ref * 1e3, tpinv_fwd_bwd_ms=b_mine * 1e3, fwd_bwd_ratio=b_mine / b_ref))
        r = rows[-1]
        print(f"{name:40s} {r['torch_ms']:9.2f} {r['tpinv_ms']:9.2f} {r['fwd_ratio']:6.1f} "
              f"{r['torch_fwd_bwd_ms']:10.2f} {r['tpinv_fwd_bwd_ms']:10.2f} {r['fwd_bwd_ratio']:6.1f}")
    write_json(a.json, {"threads": a.threads, "rows": rows})


if __name__ == "__main__":
    main()
