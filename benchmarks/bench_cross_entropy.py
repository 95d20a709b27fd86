"""The vocab-parallel cross-entropy's forward and backward on one GPU, against torch.

    python -m benchmarks.bench_cross_entropy [--tokens 4096 8192] [--vocab 151936] [--json out.json]

Per shape (bf16 logits ``[tokens, vocab]``, a random target per token, an fp32 upstream gradient):

* ``tpinv``: ``vocab_parallel_cross_entropy`` forward and its backward (the logits read in their
  own dtype, the gradient in one Triton pass);
* ``fp32 copy``: the same arithmetic by the library's ops over an fp32 copy of the logits, the
  gradient by the reference kernel's torch code and then rounded -- the composition the layer ran
  before its one-pass gradient.  Its loss and gradient must equal tpinv's byte for byte (checked
  here; the script exits non-zero otherwise);
* ``F.cross_entropy``: torch's own (``reduction="none"``, fp32 logits), not invariant: a speed peer.

Printed: median milliseconds (``triton.testing.do_bench``), the ratio to tpinv, the peak CUDA
memory above the inputs, and the time the bytes tpinv must move (logits read twice, gradient
written once) take at the device's copy bandwidth.  Needs CUDA.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import copy_gbps, device_median_ms, format_table, write_json
from tpinv.layers import vocab_parallel_cross_entropy
from tpinv.ops import sum_exp_partial
from tpinv.kernels.reference_cross_entropy import cross_entropy_grad as cross_entropy_grad_reference
from tpinv.ops.cross_entropy import cross_entropy_lse
from tpinv.testing import same_bits


def fp32_copy_path(logits, target, dloss, leaves: int = 8):
    x = logits.float()
    m = x.amax(dim=-1)
    lse = cross_entropy_lse(sum_exp_partial(x, m, leaves), m)
    outside = (target < 0) | (target >= x.shape[-1])
    picked = x.gather(-1, target.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    grad = cross_entropy_grad_reference(x, lse, target, outside, dloss).to(logits.dtype)
    return lse - picked, grad


def tpinv_path(logits, target, dloss):
    leaf = logits.detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(leaf, target)
    return loss, torch.autograd.grad(loss, (leaf,), dloss)[0]


def torch_path(logits, target, dloss):
    leaf = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(leaf, target, reduction="none")
    return loss, torch.autograd.grad(loss, (leaf,), dloss)[0].to(logits.dtype)


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def bench(tokens: int, vocab: int, copy_bw: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(tokens, vocab, device="cuda", generator=gen)).bfloat16()
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    dloss = torch.rand(tokens, device="cuda", generator=gen) / tokens
    ours = tpinv_path(logits, target, dloss)
    before = fp32_copy_path(logits, target, dloss)
    same = same_bits(before[0], ours[0]) and same_bits(before[1], ours[1])
    rows = []
    for name, fn in (("tpinv", tpinv_path), ("fp32 copy", fp32_copy_path), ("F.cross_entropy", torch_path)):
        ms = device_median_ms(lambda: fn(logits, target, dloss), rep=300)
        rows.append({"tokens": tokens, "vocab": vocab, "path": name, "ms": ms,
                     "peak_gib": peak_gib(lambda: fn(logits, target, dloss))})
    for r in rows:
        r["vs_tpinv"] = r["ms"] / rows[0]["ms"]
    rows[0]["bytes_floor_ms"] = 3 * logits.numel() * logits.element_size() / copy_bw / 1e6
    rows[1]["same_bits_as_tpinv"] = same
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cross_entropy needs a CUDA device")
    copy_bw = copy_gbps()
    rows = [r for t in args.tokens for r in bench(t, args.vocab, copy_bw)]
    print(f"device {torch.cuda.get_device_name()}; copy {copy_bw:.0f} GB/s")
    print(format_table(rows, [("tokens", "tokens"), ("path", "path"), ("ms", "ms"), ("vs_tpinv", "x tpinv"),
                              ("peak_gib", "peak GiB"), ("bytes_floor_ms", "bytes at copy speed, ms"),
                              ("same_bits_as_tpinv", "same bits")]))
    write_json(args.json, {"device": torch.cuda.get_device_name(), "copy_gbps": copy_bw, "rows": rows})
    if not all(r.get("same_bits_as_tpinv", True) for r in rows):
        sys.exit("the fp32-copy composition gave other bits than tpinv's path")


if __name__ == "__main__":
    main()
