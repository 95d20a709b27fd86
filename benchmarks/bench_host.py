"""Host time per call: each tpinv op against the PyTorch op it stands in for, eager, decode-sized.

An eager step is bound by the host when its ops cost more Python time than device time; this
measures the host side alone.  Each case is called ``--calls`` times in a row without a
synchronisation, on tensors small enough that the device keeps up, and the time until the
last call returns is divided by the count (after a warm-up and a final synchronisation, so
compilation and queueing are excluded).  Each tpinv op is also timed with bound launches
building their TMA descriptors every call (``tpinv.kernels.launch.REUSE_DESCRIPTORS`` off; only the
matmuls use descriptors), the two settings taking turns twice.  Prints a table and writes ``--json``.  On a machine
without CUDA it runs the CPU kernels (a check of the script; the numbers then include the
CPU work).

``--chain`` instead times one column-parallel matmul's host path layer by layer (the kernel
function, the op, the op recording a gradient, the layer, the layer's forward and backward,
then the backward's two products with the transposed views the backward passes and with
contiguous copies), each beside the PyTorch call it stands in for: where an eager training
step's Python goes.  ``--rows`` sets its token count (default 16); at training sizes keep
``--calls`` at 300 or fewer, so that the launches queued stay below the device's queue depth
and the host never waits for the device.

    python -m benchmarks.bench_host [--calls 500] [--json out.json] [--chain [--rows 16]]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.common import write_json
from tpinv import ops
from tpinv.kernels.launch import REUSE_DESCRIPTORS
from tpinv.models.vanilla import plain_rms_norm, plain_rope


def host_us(fn, calls: int, device) -> float:
    """Mean microseconds of host time per ``fn()`` over ``calls`` calls in a row."""
    for _ in range(10):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed / calls * 1e6


def cases(device, dtype):
    """(name, tpinv call, PyTorch call) at decode size: 16 tokens of a 0.6B-shaped model."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    x, w, w_up, x512 = rand(16, 1024), rand(1024, 1024), rand(3072, 1024), rand(512, 1024)
    g, u = rand(16, 3072), rand(16, 3072)
    norm_w = rand(1024) + 1
    q, k, v = rand(16, 16, 1, 128), rand(16, 8, 577, 128), rand(16, 8, 577, 128)
    pos = torch.full((16, 1), 576, dtype=torch.int64, device=device)
    cos, sin = (rand(16, 1, 128, dt=torch.float32) for _ in range(2))
    logits = rand(16, 151936, dt=torch.float32)
    ids = torch.randint(0, 151936, (16,), generator=gen).to(device)
    table = rand(151936, 1024)
    return [
        ("matmul 16x1024x1024 (leaves 8)", lambda: ops.matmul(x, w), lambda: F.linear(x, w)),
        ("matmul 16x3072x1024 (leaves 1)", lambda: ops.matmul(x, w_up, 1), lambda: F.linear(x, w_up)),
        ("matmul 512x3072x1024 (leaves 8)", lambda: ops.matmul(x512, w_up), lambda: F.linear(x512, w_up)),
        ("rms_norm 16x1024", lambda: ops.rms_norm(x, norm_w, 1e-6), lambda: plain_rms_norm(x, norm_w, 1e-6)),
        ("silu_mul 16x3072", lambda: ops.silu_mul(g, u), lambda: F.silu(g) * u),
        ("apply_rope 16x16x1x128", lambda: ops.apply_rope(q, cos, sin), lambda: plain_rope(q, cos, sin)),
        ("attention decode 16 x 577 slots", lambda: ops.attention(q, k, v, pos),
         lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        ("log_softmax 16x151936", lambda: ops.log_softmax(logits), lambda: F.log_softmax(logits, -1)),
        ("embedding 16 ids", lambda: ops.embedding(ids, table), lambda: F.embedding(ids, table)),
    ]


def chain_cases(device, dtype, rows=16):
    """(name, tpinv call, PyTorch call): one rows x 1024 x 1024 matmul, from the kernel up to the layer."""
    from types import SimpleNamespace
    from tpinv.layers import ColumnParallelLinear
    from tpinv.layers.functions import column_input_grad, weight_grad
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 1024, generator=gen).to(device=device, dtype=dtype)
    xg = x.clone().requires_grad_(True)
    w = torch.randn(1024, 1024, generator=gen).to(device=device, dtype=dtype)
    wg = w.clone().requires_grad_(True)
    dy = torch.randn(rows, 1024, generator=gen).to(device=device, dtype=dtype)
    w_t, dy_t, x_t = w.t().contiguous(), dy.t().contiguous(), x.t().contiguous()
    config = SimpleNamespace(params_dtype=dtype, tpinv_leaves=8, tpinv_row_strategy="tree",
                             use_cpu_initialization=device.type == "cpu")
    layer = ColumnParallelLinear(1024, 1024, config=config, init_method=torch.nn.init.zeros_, bias=False)
    layer = layer.to(device)
    linear = torch.nn.Linear(1024, 1024, bias=False, device=device, dtype=dtype)
    if device.type == "cuda":
        from tpinv.kernels.matmul_route import matmul_cuda as kernel
        extra = ()
    else:
        from tpinv.ops.registry import OPS
        kernel, extra = OPS["tpinv::matmul"].reference, (1,)

    def layer_fwd_bwd():
        layer(xg)[0].backward(dy)

    def linear_fwd_bwd():
        linear(xg).backward(dy)

    def op_fwd_bwd():
        ops.matmul(xg, wg, 1, 8).backward(dy)

    def torch_fwd_bwd():
        F.linear(xg, wg).backward(dy)

    return [
        ("torch.empty 16x1024", lambda: torch.empty(16, 1024, device=device, dtype=dtype),
         lambda: torch.empty(16, 1024, device=device, dtype=dtype)),
        ("kernel function (1 leaf)", lambda: kernel(x, w, 1, *extra), lambda: F.linear(x, w)),
        ("op, no gradient", lambda: ops.matmul(x, w, 1), lambda: F.linear(x, w)),
        ("op, recording a gradient", lambda: ops.matmul(xg, wg, 1), lambda: F.linear(xg, wg)),
        ("ColumnParallelLinear forward", lambda: layer(xg), lambda: linear(xg)),
        ("op fwd+bwd", op_fwd_bwd, torch_fwd_bwd),
        ("ColumnParallelLinear fwd+bwd", layer_fwd_bwd, linear_fwd_bwd),
        ("its backward's kernels, called", lambda: (column_input_grad(dy, w, None, 8), weight_grad(dy, x, dtype)),
         lambda: (dy @ w, dy.t() @ x)),
        ("dX kernel, W^T a view", lambda: kernel(dy, w.t(), 8, *extra), lambda: dy @ w),
        ("dX kernel, W^T contiguous", lambda: kernel(dy, w_t, 8, *extra), lambda: dy @ w),
        ("dW kernel, dY^T, X^T views", lambda: kernel(dy.t(), x.t(), 1, *extra), lambda: dy.t() @ x),
        ("dW kernel, dY^T, X^T contiguous", lambda: kernel(dy_t, x_t, 1, *extra), lambda: dy.t() @ x),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--json", default=None)
    p.add_argument("--chain", action="store_true", help="one matmul's host path, layer by layer")
    p.add_argument("--rows", type=int, default=16, help="--chain: tokens of the matmul")
    opts = p.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16
    rows = []
    if opts.chain:
        return _chain(device, dtype, opts)
    for name, mine, ref in cases(device, dtype):
        with torch.no_grad():
            reuse, build = [], []
            for _ in range(2):
                for setting, times in ((True, reuse), (False, build)):
                    REUSE_DESCRIPTORS[0] = setting
                    times.append(host_us(mine, opts.calls, device))
            REUSE_DESCRIPTORS[0] = True
            rows.append({"op": name, "tpinv_us": sum(reuse) / 2, "tpinv_descriptors_built_us": sum(build) / 2,
                         "torch_us": host_us(ref, opts.calls, device)})
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (CPU kernels)"
    print(f"host time per eager call, {label}, bf16, mean of {opts.calls} calls in a row")
    print(f"{'op':<34} {'tpinv us':>9} {'(built)':>9} {'torch us':>9} {'x':>6}")
    for r in rows:
        print(f"{r['op']:<34} {r['tpinv_us']:>9.1f} {r['tpinv_descriptors_built_us']:>9.1f} {r['torch_us']:>9.1f} "
              f"{r['tpinv_us'] / r['torch_us']:>6.1f}")
    if opts.json:
        write_json(opts.json, {"device": label, "calls": opts.calls, "rows": rows})


def _chain(device, dtype, opts) -> None:
    rows = []
    for name, mine, ref in chain_cases(device, dtype, opts.rows):
        rows.append({"call": name, "tpinv_us": host_us(mine, opts.calls, device),
                     "torch_us": host_us(ref, opts.calls, device)})
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (CPU kernels)"
    print(f"host time per eager call, one {opts.rows}x1024x1024 matmul layer by layer, {label}, bf16, "
          f"mean of {opts.calls} calls")
    print(f"{'call':<34} {'tpinv us':>9} {'torch us':>9}")
    for r in rows:
        print(f"{r['call']:<34} {r['tpinv_us']:>9.1f} {r['torch_us']:>9.1f}")
    if opts.json:
        write_json(opts.json, {"device": label, "calls": opts.calls, "rows": opts.rows, "chain": rows})


if __name__ == "__main__":
    main()
