"""Achieved memory bandwidth of the Triton SiLU-and-mul and RoPE kernels (bf16, Qwen3-8B shapes).

silu_mul at ``[T, 12288]`` and RoPE at ``x [1, 32, T, 128]`` (one fp32 ``[T, 128]`` cos/sin
table), T in {4096, 16384}, forward and backward.  Bandwidth = bytes read + written once
(inputs, outputs, tables) / median time; ``triton.testing.do_bench`` with the L2 cleared
before each call (``ms``), and CUDA-graph replays (``graph_ms``, no Python launch cost).
Compared with a measured device-to-device copy (``dst.copy_(src)`` of 1 GiB, read + write
bytes), the CPU-path torch code run on CUDA tensors (the ops' current CUDA slot) and the
vanilla bf16 formulas (``F.silu(g) * up`` and its autograd backward; the HF rotation with
bf16 tables).  ``bits_equal_torch_path`` is the fraction of output elements with the same
bits as that torch code on CUDA.  Prints a Markdown table and writes JSON (``--json PATH``).

    python -m benchmarks.bench_elementwise --json out.json [--sweep]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from benchmarks.common import copy_gbps, write_json
from tpinv.kernels import reference_activation, reference_rope
from tpinv.kernels import triton_elementwise as te

INTERMEDIATE, HEADS, HEAD_DIM = 12288, 32, 128
TOKENS = (4096, 16384)
SILU_SWEEP = ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8))
ROPE_SWEEP = ((4, 8, 64, 4), (2, 8, 64, 4), (4, 4, 64, 4), (4, 16, 64, 8), (8, 8, 64, 8), (1, 16, 64, 4))


def timed(fn, graph: bool = False) -> float | None:
    """Median ms of ``fn``; ``None`` when it cannot be captured in a CUDA graph."""
    if not graph:
        return do_bench(fn, return_mode="median")
    try:
        return do_bench_cudagraph(fn, return_mode="median")
    except Exception:  # a capture failure is reported as a missing number, not a crash
        torch.cuda.synchronize()
        return None


def bits_equal(ours, ref) -> float:
    ours, ref = (ours if isinstance(ours, tuple) else (ours,)), (ref if isinstance(ref, tuple) else (ref,))
    same = sum(int((a.view(torch.int16) == b.view(torch.int16)).sum()) for a, b in zip(ours, ref))
    return same / sum(a.numel() for a in ours)


def silu_cases(tokens: int):
    g = torch.randn(tokens, INTERMEDIATE, device="cuda", dtype=torch.bfloat16) * 3
    u = torch.randn_like(g)
    dy = torch.randn_like(g)
    n = g.numel()
    fwd = dict(op="silu_mul", direction="fwd", n_bytes=3 * n * 2,
               ours=lambda: te.silu_mul_forward_cuda(g, u),
               torch_path=lambda: reference_activation.silu_mul_forward(g, u),
               vanilla=lambda: F.silu(g) * u)
    bwd = dict(op="silu_mul", direction="bwd", n_bytes=5 * n * 2,
               ours=lambda: te.silu_mul_backward_cuda(dy, g, u),
               torch_path=lambda: reference_activation.silu_mul_backward(dy, g, u),
               vanilla=lambda: (torch.ops.aten.silu_backward(dy * u, g), dy * F.silu(g)))
    sweep = {cfg: (lambda cfg=cfg: te._launch_silu_fwd(g, u, cfg)) for cfg in SILU_SWEEP}
    return (fwd, bwd), sweep


def rope_cases(tokens: int):
    x = torch.randn(1, HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cos, sin = reference_rope.rope_cos_sin(torch.arange(tokens, device="cuda"), HEAD_DIM, 1e6)
    c16, s16, neg_s16 = cos.to(x.dtype), sin.to(x.dtype), (-sin).to(x.dtype)
    half = HEAD_DIM // 2

    def hf(t, sign):
        return t * c16 + torch.cat((-t[..., half:], t[..., :half]), -1) * (s16 if sign > 0 else neg_s16)
    n_bytes = 2 * x.numel() * 2 + 2 * cos.numel() * 4
    cases = tuple(dict(op="rope", direction=d, n_bytes=n_bytes, ours=lambda f=f: f(x, cos, sin),
                       torch_path=lambda r=r: r(x, cos, sin), vanilla=lambda sign=sign: hf(x, sign))
                  for d, f, r, sign in (("fwd", te.apply_rope_forward_cuda, reference_rope.apply_rope_forward, 1),
                                        ("bwd", te.apply_rope_backward_cuda, reference_rope.apply_rope_backward, -1)))
    sweep = {cfg: (lambda cfg=cfg: te._launch_rope(x, cos, sin, 1, cfg)) for cfg in ROPE_SWEEP}
    return cases, sweep


def measure(case: dict, tokens: int, copy: float, check_bits: bool) -> dict:
    gb = case["n_bytes"] / 1e6
    row = dict(op=case["op"], direction=case["direction"], dtype="bf16", T=tokens, bytes=case["n_bytes"])
    for key in ("ours", "torch_path", "vanilla"):
        ms = timed(case[key])
        row[f"{key}_ms"], row[f"{key}_gbps"] = ms, gb / ms
        torch.cuda.empty_cache()
    gms = timed(case["ours"], graph=True)
    row["ours_graph_ms"] = gms
    row["ours_graph_gbps"] = gb / gms if gms else None
    row["ours_frac_copy"] = row["ours_gbps"] / copy
    row["ours_graph_frac_copy"] = row["ours_graph_gbps"] / copy if gms else None
    if check_bits:
        row["bits_equal_torch_path"] = bits_equal(case["ours"](), case["torch_path"]())
    return row


def sweep_rows(op: str, tokens: int, sweep: dict, n_bytes: int, copy: float) -> list[dict]:
    rows = []
    for cfg, fn in sweep.items():
        ms = timed(fn)
        rows.append(dict(op=op, T=tokens, config=list(cfg), ms=ms, frac_copy=n_bytes / 1e6 / ms / copy))
    return rows


def run(copy: float, sweep: bool) -> tuple[list[dict], list[dict]]:
    rows, configs = [], []
    for tokens in TOKENS:
        for build in (silu_cases, rope_cases):
            cases, sweep_fns = build(tokens)
            for case in cases:
                rows.append(measure(case, tokens, copy, check_bits=tokens == TOKENS[0]))
            if sweep:
                configs += sweep_rows(cases[0]["op"], tokens, sweep_fns, cases[0]["n_bytes"], copy)
            del cases, sweep_fns
            torch.cuda.empty_cache()
    return rows, configs


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict], configs: list[dict], copy: float) -> str:
    lines = [f"copy bandwidth (d2d, 1 GiB, read + write): {copy:.0f} GB/s", "",
             "| op | dir | T | tpinv ms | GB/s | % copy | graph ms | % copy (graph) | torch-path ms | "
             "vanilla ms | bits = torch path |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['direction']} | {r['T']} | {r['ours_ms']:.3f} | {r['ours_gbps']:.0f} | "
                     f"{100 * r['ours_frac_copy']:.0f}% | {_f(r['ours_graph_ms'], '.3f')} | "
                     f"{_f(r['ours_graph_frac_copy'] and 100 * r['ours_graph_frac_copy'], '.0f')}% | "
                     f"{r['torch_path_ms']:.3f} | {r['vanilla_ms']:.3f} | "
                     f"{_f(r.get('bits_equal_torch_path'), '.4f')} |")
    if configs:
        lines += ["", "| op | T | config | ms | % copy |", "|---|---|---|---|---|"]
        lines += [f"| {c['op']} | {c['T']} | {tuple(c['config'])} | {c['ms']:.3f} | {100 * c['frac_copy']:.0f}% |"
                  for c in configs]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the records to this path")
    parser.add_argument("--sweep", action="store_true", help="also time a few block configurations (fwd)")
    args = parser.parse_args()
    copy = copy_gbps()
    rows, configs = run(copy, args.sweep)
    print(table(rows, configs, copy))
    if args.json:
        write_json(args.json, dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=copy,
                           silu_configs=SILU_SWEEP, rope_configs=ROPE_SWEEP, rows=rows, configs=configs))


if __name__ == "__main__":
    main()
