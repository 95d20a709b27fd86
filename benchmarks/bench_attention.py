"""Benchmark the Triton invariant attention against torch SDPA (Qwen3-8B attention shapes).

bf16, Hq=32, Hkv=8, D=128.  Prefill: causal S=T=4096 at B=1 and 4, forward and
forward+backward; decode: one query per sequence against T=4096 cached keys at
B=1, 4, 16, 64, timed as CUDA-graph replays over enough input sets to exceed L2 (as the
engine decodes: no Python launch cost, each layer's cache read from memory).  Times are
medians of ``triton.testing.do_bench`` (L2 flushed before each run).  ``ratio = sdpa_time / ours`` (above 1: ours is faster).  ``--check`` first runs
the bitwise invariance checks on the device and prints PASS/FAIL for each.  ``--long`` adds
long-context prefill at B=1, S=T=8192, 16384 and 32768 (with ``--check``: the last chunk of
queries and the last decode step at S=32768 equal the whole prefill's rows, bitwise).
``--sweep-backward`` instead times the backward's launch shapes (bits checked against the table's);
``--loads`` instead times the forward and the backward with their tiles read through masked
pointer loads and through TMA descriptors (bits checked equal), from CUDA-graph replays.

    python -m benchmarks.bench_attention [--check] [--json PATH] [--quick] [--long] [--sweep-backward]
                                         [--loads]
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from benchmarks.common import graph_time_us, write_json
from tpinv.testing.bits import same_bits
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128
DT = torch.bfloat16


def _inputs(B, S, T, seed=0, hq=HQ, hkv=HKV):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=DT, generator=gen)  # noqa: E731
    return mk(B, hq, S, D), mk(B, hkv, T, D), mk(B, hkv, T, D)


def _sdpa_backend():
    """The first SDPA backend that runs causal GQA here: ``(name, context factory)``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = _inputs(1, 128, 128)
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
               SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([be]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return be.name, (lambda be=be: sdpa_kernel([be]))
        except RuntimeError:
            continue
    return "default", contextlib.nullcontext


def _bench(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us


def run_checks() -> dict[str, bool]:
    """Bitwise invariance on the device at the benchmark's sizes: each check's name and verdict."""
    from tpinv.kernels.triton_attention import attention_forward_cuda as fwd
    from tpinv.kernels.triton_attention_bwd import attention_backward_cuda as bwd
    results: dict[str, bool] = {}

    def report(name, ok):
        results[name] = bool(ok)
        print(f"check {name:<44} {'PASS' if ok else 'FAIL'}")

    B, S, T = 2, 1000, 1536
    q, k, v = _inputs(B, S, S, seed=1)
    pos = torch.arange(S, device="cuda").expand(B, S).contiguous()
    full, lse = fwd(q, k, v, pos, None, True, None, None)
    kc = torch.full((B, HKV, T, D), float("nan"), device="cuda", dtype=DT)
    vc = kc.clone()
    kc[:, :, :S], vc[:, :, :S] = k, v
    ok = all(same_bits(fwd(q[:, :, c:c + 300], kc, vc, pos[:, c:c + 300].contiguous(),
                           None, True, None, None)[0], full[:, :, c:c + 300])
             for c in range(0, S, 300))
    report("prefill == chunked prefill (NaN cache tail)", ok)
    ok = all(same_bits(fwd(q[:, :, i:i + 1], kc, vc, pos[:, i:i + 1].contiguous(), None, True,
                           None, None)[0], full[:, :, i:i + 1]) for i in (0, 64, 511, S - 1))
    report("prefill == decode steps", ok)
    report("row alone == row in batch", same_bits(
        fwd(q[1:], k[1:], v[1:], pos[1:], None, True, None, None)[0], full[1:]))
    dout = torch.randn_like(q)
    g_full = bwd(dout, None, q, k, v, full, lse, pos, None, True, None, None)
    o1, l1 = fwd(q[1:], k[1:], v[1:], pos[1:], None, True, None, None)
    g_one = bwd(dout[1:], None, q[1:], k[1:], v[1:], o1, l1, pos[1:], None, True, None, None)
    report("grads alone == grads in batch",
           all(same_bits(a, b[1:]) for a, b in zip(g_one, g_full)))
    L = 700
    o2, l2 = fwd(q[:1, :, :L], k[:1, :, :L], v[:1, :, :L], pos[:1, :L], None, True, None, None)
    g_short = bwd(dout[:1, :, :L], None, q[:1, :, :L], k[:1, :, :L], v[:1, :, :L], o2, l2,
                  pos[:1, :L], None, True, None, None)
    d_pad = dout[:1].clone()
    d_pad[:, :, L:] = 0
    o3, l3 = fwd(q[:1], k[:1], v[:1], pos[:1], None, True, None, None)
    g_pad = bwd(d_pad, None, q[:1], k[:1], v[:1], o3, l3, pos[:1], None, True, None, None)
    report("grads == grads with right padding rows", all(
        same_bits(a, b[:, :, :L]) for a, b in zip(g_short, g_pad)))
    van = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    report("control: SDPA prefill != SDPA decode", any(not same_bits(
        F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1],
                                       enable_gqa=True), van[:, :, i:i + 1])
        for i in (511, 700, S - 1)))
    return results


def run_long_checks(S: int = 32768) -> dict[str, bool]:
    """At long context: the last 512 queries run as a chunk, and the last query as a decode
    step, against the whole cache equal the whole prefill's rows, bitwise (control: SDPA's
    decode of the last query differs from its prefill's row)."""
    from tpinv.kernels.triton_attention import attention_forward_cuda as fwd
    q, k, v = _inputs(1, S, S, seed=7)
    pos = torch.arange(S, device="cuda").expand(1, S).contiguous()
    full = fwd(q, k, v, pos, None, True, None, None)[0]
    chunk = fwd(q[:, :, -512:], k, v, pos[:, -512:].contiguous(), None, True, None, None)[0]
    step = fwd(q[:, :, -1:], k, v, pos[:, -1:].contiguous(), None, True, None, None)[0]
    van = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    van_step = F.scaled_dot_product_attention(q[:, :, -1:], k, v, enable_gqa=True)
    results = {f"S={S}: last 512 queries as a chunk == prefill": same_bits(chunk, full[:, :, -512:]),
               f"S={S}: last query as a decode step == prefill": same_bits(step, full[:, :, -1:]),
               f"S={S}: control: SDPA decode != SDPA prefill": not same_bits(van_step, van[:, :, -1:])}
    for name, ok in results.items():
        print(f"check {name:<44} {'PASS' if ok else 'FAIL'}")
    return results


def bench_prefill(B, S, backend_ctx):
    from tpinv.kernels.triton_attention import attention_forward_cuda as fwd
    from tpinv.kernels.triton_attention_bwd import attention_backward_cuda as bwd
    q, k, v = _inputs(B, S, S, seed=B)
    pos = torch.arange(S, device="cuda").expand(B, S).contiguous()
    dout = torch.randn_like(q)
    rec = dict(kind="prefill", B=B, S=S, T=S)
    rec["ours_fwd_us"] = _bench(lambda: fwd(q, k, v, pos, None, True, None, None))

    def ours_fb():
        out, lse = fwd(q, k, v, pos, None, True, None, None)
        bwd(dout, None, q, k, v, out, lse, pos, None, True, None, None)
    rec["ours_fwdbwd_us"] = _bench(ours_fb)
    with backend_ctx():
        rec["sdpa_fwd_us"] = _bench(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def sdpa_fb():
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, leaves, dout)
        rec["sdpa_fwdbwd_us"] = _bench(sdpa_fb)
    flops = 4 * B * HQ * S * S * D / 2
    for part, mult in (("fwd", 1.0), ("fwdbwd", 3.5)):
        rec[f"ratio_{part}"] = rec[f"sdpa_{part}_us"] / rec[f"ours_{part}_us"]
        rec[f"ours_{part}_tflops"] = mult * flops / rec[f"ours_{part}_us"] / 1e6
        rec[f"sdpa_{part}_tflops"] = mult * flops / rec[f"sdpa_{part}_us"] / 1e6
    return rec


def bench_decode(B, T, backend_ctx):
    """One query per sequence against ``T`` cached keys: CUDA-graph replays (the engine decodes
    from graphs) cycling through enough input sets that the KV caches are read from memory."""
    from tpinv.kernels.triton_attention import attention_forward_cuda as fwd
    kv_bytes = 2 * B * HKV * T * D * DT.itemsize
    sets = max(1, min(8, -(-2 * torch.cuda.get_device_properties(0).L2_cache_size // kv_bytes)))
    data = [(*_inputs(B, 1, T, seed=100 + 8 * B + i), torch.full((B, 1), T - 1, device="cuda"))
            for i in range(sets)]
    est = kv_bytes / 2e6  # us at ~2 TB/s
    from tpinv.kernels import triton_attention as ta
    from tpinv.kernels import triton_attention_split as sp
    split = sp.use_split(B, HKV, HQ // HKV, ta.forward_config(DT, D).block_m, T, ta.KV_BLOCK,
                         ta.KV_CHUNK_BLOCKS, D)
    q, k, v, pos = *data[0][:3], data[0][3]
    gluon = split and sp.decode_kernel_for(sp.SplitLaunch(
        q, k, v, pos, *ta.mask_args(None, q), HQ // HKV, True, None, ta.resolve_scale(None, D),
        False, ta.forward_config(DT, D), D, ta.KV_BLOCK, ta.KV_CHUNK_BLOCKS)) is not None
    rec = dict(kind="decode", B=B, S=1, T=T, input_sets=sets, timing="cuda graph replays",
               path=("chunks in parallel, Gluon" if gluon else "chunks in parallel") if split
               else "one program")
    rec["ours_us"] = graph_time_us(lambda i: fwd(*data[i][:3], data[i][3], None, True, None, None), sets, est)
    rec["sdpa_us"] = graph_time_us(
        lambda i: F.scaled_dot_product_attention(*data[i][:3], enable_gqa=True), sets, est)
    rec["ratio"] = rec["sdpa_us"] / rec["ours_us"]
    rec["ours_kv_GBps"] = kv_bytes / rec["ours_us"] / 1e3
    rec["sdpa_kv_GBps"] = kv_bytes / rec["sdpa_us"] / 1e3
    return rec


def sweep_backward() -> list[dict]:
    """Every backward launch shape (``BACKWARD_CANDIDATES``) beside the table's: bits checked against
    the table's (dq, dk, dv), then the backward alone timed, at a Qwen3-0.6B training shape (4 x 1024
    tokens, 16 / 8 heads) and a Qwen3-8B one (1 x 4096, 32 / 8 heads)."""
    from tpinv.kernels.triton_attention import attention_forward_cuda as fwd
    from tpinv.kernels.triton_attention_bwd import (BACKWARD_CANDIDATES, attention_backward_cuda as bwd,
                                                    backward_config)
    out = []
    for B, S, hq, hkv in ((4, 1024, 16, 8), (1, 4096, 32, 8)):
        q, k, v = _inputs(B, S, S, seed=S, hq=hq, hkv=hkv)
        dout = torch.randn_like(q)
        pos = torch.arange(S, device="cuda").expand(B, S).contiguous()
        o, lse = fwd(q, k, v, pos, None, True, None, None)
        args = (dout, None, q, k, v, o, lse, pos, None, True, None, None)
        want = bwd(*args)
        table_cfg = backward_config(DT, D)
        base = _bench(lambda: bwd(*args))
        flops = 2.5 * 4 * B * hq * S * S * D / 2
        print(f"backward B={B} S={S} Hq={hq}: table {table_cfg} {base:.0f} us "
              f"({flops / base / 1e6:.0f} TFLOP/s)", flush=True)
        out.append(dict(kind="backward sweep", B=B, S=S, Hq=hq, Hkv=hkv, config=str(table_cfg),
                        table=True, same_bits=True, us=base))
        for cfg in BACKWARD_CANDIDATES:
            try:
                got = bwd(*args, config=cfg)
                same = all(same_bits(a, b) for a, b in zip(got, want))
                us = _bench(lambda: bwd(*args, config=cfg))
            except Exception as exc:   # a shape that does not compile (resources) is recorded
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                out.append(dict(kind="backward sweep", B=B, S=S, Hq=hq, config=str(cfg), error=str(exc)[:500]))
                continue
            print(f"  {cfg}: {us:.0f} us ({base / us:.2f}x the table's) same bits {same}", flush=True)
            out.append(dict(kind="backward sweep", B=B, S=S, Hq=hq, Hkv=hkv, config=str(cfg), table=False,
                            same_bits=same, us=us, speedup=base / us))
        sd = [t.detach().requires_grad_() for t in (q, k, v)]
        name, ctx = _sdpa_backend()
        with ctx():
            def sdpa_bwd():
                y = F.scaled_dot_product_attention(*sd, is_causal=True, enable_gqa=True)
                torch.autograd.grad(y, sd, dout)
            fb = _bench(sdpa_bwd)
            f = _bench(lambda: F.scaled_dot_product_attention(*sd, is_causal=True, enable_gqa=True))
        print(f"  SDPA ({name}) backward ~{fb - f:.0f} us (forward+backward {fb:.0f} - forward {f:.0f})",
              flush=True)
        out.append(dict(kind="backward sweep", B=B, S=S, Hq=hq, config=f"sdpa {name}", sdpa_bwd_us=fb - f))
    return out


#: (B, S, Hq, Hkv) of ``--loads``: Qwen3-0.6B's training shape, a Qwen3-8B prefill, short sequences.
LOADS_SHAPES = ((4, 1024, 16, 8), (1, 4096, 32, 8), (8, 512, 16, 8), (16, 256, 16, 8))


def compare_loads(shapes=LOADS_SHAPES) -> list[dict]:
    """The forward and the backward with pointer loads (``tma=False``) and TMA descriptors
    (``tma=True``) at Qwen3-0.6B's training shape, a Qwen3-8B prefill and short sequences: the
    outputs' bytes compared, each call timed from CUDA-graph replays (no host time)."""
    from tpinv.kernels.triton_attention import attention_forward_cuda as fwd
    from tpinv.kernels.triton_attention_bwd import attention_backward_cuda as bwd
    out = []
    print(f"{'B x S':>10}{'Hq/Hkv':>8} | {'fwd ptr us':>10}{'tma':>8}{'x':>6} | {'bwd ptr us':>10}{'tma':>8}"
          f"{'x':>6} | same bits")
    for B, S, hq, hkv in shapes:
        q, k, v = _inputs(B, S, S, seed=S + B, hq=hq, hkv=hkv)
        dout = torch.randn_like(q)
        pos = torch.arange(S, device="cuda").expand(B, S).contiguous()
        r = dict(kind="loads", B=B, S=S, Hq=hq, Hkv=hkv)
        outs = {}
        for tma in (False, True):
            name = "tma" if tma else "ptr"
            o, lse = fwd(q, k, v, pos, None, True, None, None, split=False, tma=tma)
            grads = bwd(dout, None, q, k, v, o, lse, pos, None, True, None, None, tma=tma)
            outs[name] = (o, lse, *grads)
            r[f"fwd_{name}_us"] = graph_time_us(
                lambda i, tma=tma: fwd(q, k, v, pos, None, True, None, None, split=False, tma=tma), 1, 100.0)
            r[f"bwd_{name}_us"] = graph_time_us(
                lambda i, tma=tma, o=o, lse=lse: bwd(dout, None, q, k, v, o, lse, pos, None, True, None, None,
                                                     tma=tma), 1, 250.0)
        r["same_bits"] = all(same_bits(a, b) for a, b in zip(outs["ptr"], outs["tma"]))
        r["fwd_speedup"] = r["fwd_ptr_us"] / r["fwd_tma_us"]
        r["bwd_speedup"] = r["bwd_ptr_us"] / r["bwd_tma_us"]
        print(f"{f'{B} x {S}':>10}{f'{hq}/{hkv}':>8} | {r['fwd_ptr_us']:>10.1f}{r['fwd_tma_us']:>8.1f}"
              f"{r['fwd_speedup']:>6.2f} | {r['bwd_ptr_us']:>10.1f}{r['bwd_tma_us']:>8.1f}"
              f"{r['bwd_speedup']:>6.2f} | {r['same_bits']}", flush=True)
        out.append(r)
    return out


def kernel_resources() -> list[dict]:
    """Registers and spills of every compiled forward kernel (from Triton's per-device cache)."""
    from tpinv.kernels import triton_attention
    out = []
    for cache in getattr(triton_attention._attn_fwd_kernel, "device_caches", {}).values():
        for kernel in cache[0].values():
            out.append(dict(kernel="_attn_fwd_kernel", n_regs=getattr(kernel, "n_regs", None),
                            n_spills=getattr(kernel, "n_spills", None)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="bitwise invariance checks first")
    ap.add_argument("--json", help="write the records to this path")
    ap.add_argument("--quick", action="store_true", help="B=1 prefill and B=1, 64 decode only")
    ap.add_argument("--long", action="store_true", help="also B=1 prefill at S=8192, 16384, 32768")
    ap.add_argument("--sweep-backward", action="store_true",
                    help="only the backward's launch shapes, bits checked and timed")
    ap.add_argument("--loads", action="store_true",
                    help="only pointer loads vs TMA descriptors, forward and backward, bits checked")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if args.sweep_backward or args.loads:
        swept = sweep_backward() if args.sweep_backward else compare_loads()
        if args.json:
            write_json(args.json, dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__),
                                       records=swept))
        return 0 if all(r.get("same_bits", True) for r in swept) else 1
    checks: dict[str, bool] = {}
    if args.check:
        checks.update(run_checks())
    if args.check and args.long:
        checks.update(run_long_checks())
    status = 0 if all(checks.values()) else 1
    name, ctx = _sdpa_backend()
    print(f"device {torch.cuda.get_device_name()}  SDPA backend (prefill): {name}")
    records = []
    print(f"{'prefill':<8}{'B':>3}{'S':>6} | {'ours fwd us':>11}{'sdpa':>9}{'ratio':>7}{'TF/s':>6}"
          f" | {'ours f+b us':>11}{'sdpa':>9}{'ratio':>7}{'TF/s':>6}")
    prefills = [(B, 4096) for B in ((1,) if args.quick else (1, 4))]
    prefills += [(1, S) for S in ((8192, 16384, 32768) if args.long else ())]
    for B, S in prefills:
        r = bench_prefill(B, S, ctx)
        records.append(r)
        print(f"{'':<8}{B:>3}{S:>6} | {r['ours_fwd_us']:>11.0f}{r['sdpa_fwd_us']:>9.0f}"
              f"{r['ratio_fwd']:>7.2f}{r['ours_fwd_tflops']:>6.0f} | {r['ours_fwdbwd_us']:>11.0f}"
              f"{r['sdpa_fwdbwd_us']:>9.0f}{r['ratio_fwdbwd']:>7.2f}"
              f"{r['ours_fwdbwd_tflops']:>6.0f}")
    print(f"{'decode':<8}{'B':>3}{'T':>6} | {'ours us':>11}{'sdpa':>9}{'ratio':>7}"
          f"{'ours GB/s':>11}{'sdpa GB/s':>11}")
    for B in ((1, 64) if args.quick else (1, 4, 16, 64)):
        r = bench_decode(B, 4096, ctx)
        records.append(r)
        print(f"{'':<8}{B:>3}{4096:>6} | {r['ours_us']:>11.1f}{r['sdpa_us']:>9.1f}"
              f"{r['ratio']:>7.2f}"
              f"{r['ours_kv_GBps']:>11.0f}{r['sdpa_kv_GBps']:>11.0f}  {r['path']}")
    resources = kernel_resources()
    for r in resources:
        print(f"kernel {r['kernel']:<22} registers {r['n_regs']}  spills {r['n_spills']}")
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), sdpa_backend=name, torch=torch.__version__,
                    kernels=resources)
        write_json(args.json, dict(meta=meta, checks=checks, records=records))
    return status


if __name__ == "__main__":
    sys.exit(main())
