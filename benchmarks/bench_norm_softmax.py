"""Achieved memory bandwidth of the Triton RMSNorm and softmax-family kernels.

Bandwidth = bytes read + written once (input, output, weight) / median time
(``triton.testing.do_bench``), against a measured device-to-device copy and against the
plain torch ops (the HF RMSNorm formula, ``F.log_softmax``, ``F.softmax``,
``torch.logsumexp``).  The softmax rows time the public one-launch kernels
(``log_softmax_forward_cuda``, ``softmax_forward_cuda``, ``logsumexp_forward_cuda``: the row read
once, plus the ``[T]`` result; long rows run one program per leaf, its leaf held in shared memory
on an sm_90 GPU) and, beside them, the same by-leaves kernel reading its leaf through L2 and the
one-program-per-row kernel, in fp32, bf16 and fp16 (``--softmax-dtypes``); each public op is also
timed replayed from a CUDA graph (no launch gaps, no host time), and its bytes are checked first
against the row kernel's on rows of special values and on the timed input (the run exits 1 if
any differ).  ``--softmax-only`` skips RMSNorm.  Prints a Markdown table and writes JSON
(``--json PATH``).  ``--sweep`` also times the held-leaf kernel's launch shapes (warps, programs per SM) for
log_softmax, softmax and the statistics alone, each checked first to give the row kernel's bytes.

    python -m benchmarks.bench_norm_softmax [--softmax-only] [--sweep] --json out.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from benchmarks.common import copy_gbps as copy_bandwidth_gbps, graph_time_us, write_json
from tpinv.core.contract import DEFAULT_LEAVES
from tpinv.kernels.triton_norm import (rms_norm_backward_cuda, rms_norm_backward_heads_cuda,
                                      rms_norm_forward_cuda, tile_for)
from tpinv.kernels import triton_softmax, triton_softmax_leaves
from tpinv.kernels.triton_softmax import (log_softmax_forward_cuda, logsumexp_forward_cuda,
                                         softmax_forward_cuda)
from tpinv.models.vanilla import plain_rms_norm
from tpinv.kernels.reference_softmax import logsumexp_from_parts
from tpinv.testing import same_bits, special_rows

#: The softmax rows' vocabulary (Qwen3's).
VOCAB = 151936
#: The softmax rows' dtypes, by the names ``--softmax-dtypes`` takes.
SOFTMAX_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def gbps(n_bytes: int, fn) -> tuple[float, float]:
    ms = do_bench(fn, return_mode="median")
    return ms, n_bytes / ms / 1e6


def through_l2(fn):
    """``fn`` with the by-leaves kernel reading its leaf through L2 (the held path off)."""
    def call():
        triton_softmax_leaves.HELD[0] = False
        try:
            return fn()
        finally:
            triton_softmax_leaves.HELD[0] = True
    return call


def run_norm(copy_gbps: float) -> list[dict]:
    """RMSNorm forward and backward, bf16, against the HF formula in torch."""
    rows = []
    shapes = [(tokens, hidden) for tokens in (4096, 16384) for hidden in (1024, 4096, 8192)]
    shapes += [(4096, 16, 128), (4096, 8, 128)]            # Qwen3 q/k norm: [T, heads, head_dim]
    for shape in shapes:
        tokens, hidden = shape[0], shape[-1]
        heads = shape[1] if len(shape) == 3 else 1
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
        n_bytes = 2 * x.numel() * 2 + hidden * 2
        ms, bw = gbps(n_bytes, lambda: rms_norm_forward_cuda(x, w, 1e-6))
        tms, tbw = gbps(n_bytes, lambda: plain_rms_norm(x, w, 1e-6))
        g = torch.randn_like(x)
        # g and x read, dx written, and the fp32 dweight partials (one per tile of rows) written
        # and read back by the token sum
        _, tile_rows, _ = tile_for(hidden)
        b_bytes = 3 * x.numel() * 2 + 2 * (x.numel() // tile_rows) * 4
        backward = ((lambda: rms_norm_backward_heads_cuda(g, x, w, 1e-6)) if heads > 1 else
                    (lambda: rms_norm_backward_cuda(g, x, w, 1e-6)))
        bms, bbw = gbps(b_bytes, backward)
        rows.append(dict(op="rms_norm", dtype="bf16", T=tokens, H=hidden, heads=heads, ms=ms, gbps=bw,
                         frac_copy=bw / copy_gbps, torch_ms=tms, torch_gbps=tbw,
                         bwd_ms=bms, bwd_gbps=bbw, bwd_frac_copy=bbw / copy_gbps))
        del x, g
    return rows


def bytes_match(op, mode: int, x: torch.Tensor) -> bool:
    """Whether the public ``op`` gives the row kernel's bytes on ``x`` (logsumexp: its max and
    total's ``logsumexp_from_parts``, rounded once)."""
    ts = triton_softmax
    got = op(x, DEFAULT_LEAVES)
    out, m, s = ts._fused(x, DEFAULT_LEAVES, mode, ts._FUSED_CONFIG[x.dtype])
    want = logsumexp_from_parts(m, s).to(x.dtype) if mode == ts._MODE_STATS else out
    return same_bits(got, want)


def run_softmax(copy_gbps: float, dtypes: tuple = ("fp32", "bf16", "fp16")) -> list[dict]:
    """The softmax family at 1024 and 4096 rows of Qwen3's vocabulary, each dtype: the public ops
    (eager and replayed from a CUDA graph), their by-leaves kernel through L2, the row kernel and
    torch; each public op's bytes first checked against the row kernel's on rows of special
    values (:func:`tpinv.testing.special_rows`) and on the timed input."""
    ts = triton_softmax
    softmax_ops = (("log_softmax", log_softmax_forward_cuda, F.log_softmax, ts._MODE_LOG),
                   ("softmax", softmax_forward_cuda, F.softmax, ts._MODE_SOFTMAX),
                   ("logsumexp", logsumexp_forward_cuda, torch.logsumexp, ts._MODE_STATS))
    rows = []
    for name in dtypes:
        dtype = SOFTMAX_DTYPES[name]
        for tokens in (1024, 4096):
            gen = torch.Generator().manual_seed(tokens)
            special = special_rows(torch.randn(32, VOCAB, generator=gen).to(dtype)).cuda()
            x = torch.randn(tokens, VOCAB, device="cuda", dtype=dtype)
            row_cfg = ts._FUSED_CONFIG[dtype]
            for op, ours, theirs, mode in softmax_ops:
                same = bytes_match(ours, mode, special) and bytes_match(ours, mode, x)
                # the row read and written once; logsumexp writes one value a row
                written = tokens if mode == ts._MODE_STATS else x.numel()
                n_bytes = (x.numel() + written) * x.element_size()
                ms, bw = gbps(n_bytes, lambda: ours(x, DEFAULT_LEAVES))
                gms = graph_time_us(lambda _: ours(x, DEFAULT_LEAVES), 1, 1e3 * ms) / 1e3
                tms, tbw = gbps(n_bytes, lambda: theirs(x, -1))
                rms, rbw = gbps(n_bytes, lambda: ts._fused(x, DEFAULT_LEAVES, mode, row_cfg))
                lms, lbw = gbps(n_bytes, through_l2(lambda: ours(x, DEFAULT_LEAVES)))
                rows.append(dict(op=op, dtype=name, T=tokens, V=VOCAB, ms=ms, gbps=bw,
                                 frac_copy=bw / copy_gbps, same_bytes=same, graph_ms=gms,
                                 graph_frac_copy=n_bytes / gms / 1e6 / copy_gbps,
                                 torch_ms=tms, torch_gbps=tbw,
                                 row_kernel_ms=rms, row_kernel_frac_copy=rbw / copy_gbps,
                                 l2_ms=lms, l2_frac_copy=lbw / copy_gbps))
                print(f"{op} {name} T={tokens}: {100 * bw / copy_gbps:.1f}% of copy "
                      f"(graph {100 * n_bytes / gms / 1e6 / copy_gbps:.1f}%) same bytes={same}",
                      flush=True)
            del x, special
            torch.cuda.empty_cache()
    return rows


#: --sweep: launch shapes of the held-leaf kernel (warps, programs per SM, stagger_ns)
SWEEP = ([(warps, per_sm, 0) for warps in (4, 8) for per_sm in (2, 3, 4, 6)]
         + [(4, per_sm, ns) for per_sm in (2, 5) for ns in (0, 1000, 2000, 3000, 4000)])


def sweep(copy_gbps: float, tokens: int = 4096, dtypes: tuple = ("fp32", "bf16")) -> list[dict]:
    """Time the held-leaf kernel's launch shapes (bytes checked against the row kernel first)."""
    from tpinv.kernels.triton_softmax_leaves import softmax_rows_by_leaves
    rows = []
    ts = triton_softmax
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        if name not in dtypes:
            continue
        x = torch.randn(tokens, VOCAB, device="cuda", dtype=dtype)
        if triton_softmax_leaves.held_module(x, VOCAB // DEFAULT_LEAVES) is None:
            raise SystemExit("--sweep times the held-leaf kernel: it runs on an sm_90 GPU only")
        for mode, op in ((ts._MODE_LOG, "log_softmax"), (ts._MODE_SOFTMAX, "softmax"),
                         (ts._MODE_STATS, "max_sum")):
            want = ts._fused(x, DEFAULT_LEAVES, mode, ts._FUSED_CONFIG[dtype])
            n_bytes = x.numel() * x.element_size() * (1 if mode == ts._MODE_STATS else 2)
            for cfg in SWEEP:
                try:
                    got = softmax_rows_by_leaves(x, DEFAULT_LEAVES, mode, held_config=cfg)
                    same = all(same_bits(g, w) for g, w in zip(got, want) if w is not None)
                    ms, bw = gbps(n_bytes, lambda: softmax_rows_by_leaves(x, DEFAULT_LEAVES, mode,
                                                                          held_config=cfg))
                except Exception as exc:  # a config that does not compile (resources) is recorded
                    print(f"{op} {name} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                rows.append(dict(op=op, dtype=name, T=tokens, config=list(cfg), same_bytes=same,
                                 ms=ms, gbps=bw, frac_copy=bw / copy_gbps))
                print(f"{op} {name} T={tokens} {cfg}: {100 * bw / copy_gbps:.0f}% same={same}", flush=True)
        del x
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], copy_gbps: float) -> str:
    lines = [f"copy bandwidth (d2d, 2 GiB): {copy_gbps:.0f} GB/s", "",
             "| op | dtype | shape | tpinv ms | tpinv GB/s | % of copy | graph % of copy | same bytes "
             "| through L2 % of copy | row kernel % of copy | torch ms | torch GB/s | bwd GB/s (% copy) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = (f"T={r['T']} H={r['H']}" + (f" heads={r['heads']}" if r.get("heads", 1) > 1 else "")
                 if r["op"] == "rms_norm" else f"T={r['T']} V={r['V']}")
        bwd = f"{r['bwd_gbps']:.0f} ({100 * r['bwd_frac_copy']:.0f}%)" if "bwd_gbps" in r else "-"
        row_kernel = f"{100 * r['row_kernel_frac_copy']:.1f}%" if "row_kernel_frac_copy" in r else "-"
        l2 = f"{100 * r['l2_frac_copy']:.1f}%" if "l2_frac_copy" in r else "-"
        graph = f"{100 * r['graph_frac_copy']:.1f}%" if "graph_frac_copy" in r else "-"
        same = {True: "yes", False: "**NO**"}.get(r.get("same_bytes"), "-")
        lines.append(f"| {r['op']} | {r['dtype']} | {shape} | {r['ms']:.3f} | {r['gbps']:.0f} | "
                     f"{100 * r['frac_copy']:.1f}% | {graph} | {same} | {l2} | {row_kernel} | "
                     f"{r['torch_ms']:.3f} | {r['torch_gbps']:.0f} | {bwd} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the records to this path")
    parser.add_argument("--softmax-only", action="store_true", help="skip the RMSNorm rows")
    parser.add_argument("--softmax-dtypes", default="fp32,bf16,fp16",
                        help=f"the softmax rows' dtypes, of {','.join(SOFTMAX_DTYPES)}")
    parser.add_argument("--sweep", action="store_true", help="also time the held-leaf kernel's launch shapes")
    parser.add_argument("--sweep-dtypes", default="fp32,bf16", help="the dtypes --sweep times")
    args = parser.parse_args()
    dtypes = tuple(args.softmax_dtypes.split(","))
    unknown = [d for d in dtypes if d not in SOFTMAX_DTYPES]
    if unknown:
        parser.error(f"--softmax-dtypes: unknown {unknown}; choose from {','.join(SOFTMAX_DTYPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_norm_softmax times CUDA kernels: no CUDA device here")
    copy_gbps = copy_bandwidth_gbps(2 << 30)
    rows = ([] if args.softmax_only else run_norm(copy_gbps)) + run_softmax(copy_gbps, dtypes)
    print(table(rows, copy_gbps))
    swept = sweep(copy_gbps, dtypes=tuple(args.sweep_dtypes.split(","))) if args.sweep else []
    for op in sorted({r["op"] + " " + r["dtype"] + " T=" + str(r["T"]) for r in swept}):
        best = max((r for r in swept if f"{r['op']} {r['dtype']} T={r['T']}" == op and r["same_bytes"]),
                   key=lambda r: r["gbps"])
        print(f"best {op}: {best['config']} {100 * best['frac_copy']:.0f}% of copy")
    if args.json:
        write_json(args.json, dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                   copy_gbps=copy_gbps, rows=rows, sweep=swept))
    differ = [f"{r['op']} {r['dtype']} T={r['T']}" for r in rows + swept if r.get("same_bytes") is False]
    if differ:
        raise SystemExit(f"bytes differ from the row kernel's: {', '.join(differ)}")


if __name__ == "__main__":
    main()
