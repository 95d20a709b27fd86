"""Position independence of the CPU primitives on the invariant paths, per kernel set.

PyTorch picks its CPU kernels by instruction set (``ATEN_CPU_CAPABILITY``: ``avx512``,
``avx2``, ``default``; ``sve256``/``default`` on ARM), read once when torch is imported.
An elementwise op is usable on an invariant path only if an element's bits are a function of
its value alone under the set in use: the same whether it lands in a vector body or in a
scalar tail, at any storage offset, beside a broadcast (stride-0) operand or in place.

:func:`position_dependent` runs every primitive of :data:`PRIMITIVES` (and the composites the
kernels build from them) over the same values placed at offsets 0..17 of lengths 1..70, and
compares each element with the element computed alone (a 1-element tensor): it returns the
names that differ anywhere.  :func:`bits_digest` hashes each primitive's results on a fixed
pool, to compare the bits *across* sets.  :func:`run_in_kernel_set` does both in a fresh
interpreter under a forced set (the capability is read once, at torch import).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from typing import Callable

import torch

#: Lengths and storage offsets: every element lands in vector bodies and in scalar tails.
LENGTHS = range(1, 71)
OFFSETS = range(0, 18)
POOL = 97  # values per pool (prime, > max length: a value visits many positions)


def _pool(kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
    x = torch.randn(POOL, generator=gen, dtype=torch.float64)
    if kind == "positive":
        x = x.abs() * 4 + 1e-3
    elif kind == "signed":
        x = x * 6
    elif kind == "small":  # softmax-shifted scores: exp arguments <= 0
        x = -x.abs() * 20
    x = x.to(dtype)
    if kind == "signed":
        x[:4] = torch.tensor([0.0, -0.0, 1.0, -1.0], dtype=dtype)
    return x


def _silu(g):
    return g / (torch.exp(torch.neg(g)) + 1.0)


def _inplace(method: str):
    def fn(a, b):
        out = a.clone()
        getattr(out, method)(b)
        return out
    return fn


def _inplace_scalar(method: str, s):
    def fn(a):
        out = a.clone()
        getattr(out, method)(s) if s is not None else getattr(out, method)()
        return out
    return fn


#: name -> (fn, pool kinds of its operands, operand dtype).  Unary ops take one tensor,
#: binary ops two of the same shape.  Every op the CPU kernels, the optimizer, the models
#: and the sampler apply elementwise is here; casts round fp32 to 16 bits (and back).
PRIMITIVES: dict[str, tuple[Callable, tuple[str, ...], torch.dtype]] = {
    "neg": (torch.neg, ("signed",), torch.float32),
    "abs": (torch.abs, ("signed",), torch.float32),
    "exp": (torch.exp, ("signed",), torch.float32),
    "exp(x<=0)": (torch.exp, ("small",), torch.float32),
    "log": (torch.log, ("positive",), torch.float32),
    "cos": (torch.cos, ("signed",), torch.float32),
    "sin": (torch.sin, ("signed",), torch.float32),
    "theta**x (rope inv_freq)": (lambda x: 10000.0 ** x, ("signed",), torch.float32),
    "sqrt": (torch.sqrt, ("positive",), torch.float32),
    "rsqrt": (torch.rsqrt, ("positive",), torch.float32),
    "reciprocal": (torch.reciprocal, ("positive",), torch.float32),
    "silu g/(exp(-g)+1)": (_silu, ("signed",), torch.float32),
    "isinf": (torch.isinf, ("signed",), torch.float32),
    "fp32->bf16": (lambda x: x.to(torch.bfloat16), ("signed",), torch.float32),
    "fp32->fp16": (lambda x: x.to(torch.float16), ("signed",), torch.float32),
    "bf16->fp32": (lambda x: x.to(torch.float32), ("signed",), torch.bfloat16),
    "fp16->fp32": (lambda x: x.to(torch.float32), ("signed",), torch.float16),
    "add": (torch.add, ("signed", "positive"), torch.float32),
    "sub": (torch.sub, ("signed", "positive"), torch.float32),
    "mul": (torch.mul, ("signed", "positive"), torch.float32),
    "div": (torch.div, ("signed", "positive"), torch.float32),
    "maximum": (torch.maximum, ("signed", "small"), torch.float32),
    "where(a>b,a,b-a)": (lambda a, b: torch.where(a > b, a, b - a), ("signed", "small"), torch.float32),
    "add_": (_inplace("add_"), ("signed", "positive"), torch.float32),
    "sub_": (_inplace("sub_"), ("signed", "positive"), torch.float32),
    "mul_": (_inplace("mul_"), ("signed", "positive"), torch.float32),
    "div_": (_inplace("div_"), ("signed", "positive"), torch.float32),
    "x+0.5": (lambda x: x + 0.5, ("signed",), torch.float32),
    "x*0.9": (lambda x: x * 0.9, ("signed",), torch.float32),
    "x/3.0": (lambda x: x / 3.0, ("signed",), torch.float32),
    "1.0-x": (lambda x: 1.0 - x, ("signed",), torch.float32),
    "mul_(0.95)": (_inplace_scalar("mul_", 0.95), ("signed",), torch.float32),
    "add_(1e-8)": (_inplace_scalar("add_", 1e-8), ("positive",), torch.float32),
    "sqrt_": (_inplace_scalar("sqrt_", None), ("positive",), torch.float32),
}


def _place(values: torch.Tensor, n: int, offset: int) -> torch.Tensor:
    """``values[(offset + i) % POOL]`` for ``i < n``, at storage offset ``offset`` of a buffer."""
    buf = torch.full((offset + n,), 7.0, dtype=values.dtype)
    buf[offset:] = values[(offset + torch.arange(n)) % POOL]
    return buf[offset:]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Raw bits as integers (bool kept as is): compares -0.0/+0.0 and NaN payloads too."""
    if t.dtype == torch.bool:
        return t
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def _layouts(fn, pools, n, offset):
    """``(layout, result, (a_fixed, b_fixed), pool indices)`` of ``fn`` on the placed operands.

    ``a_fixed``/``b_fixed`` name an operand held at one pool element (broadcast), else None.
    """
    args = [_place(p, n, offset) for p in pools]
    idx = (offset + torch.arange(n)) % POOL
    o = offset % POOL
    yield "slice", fn(*args), (None, None), idx
    if len(args) == 2:  # one operand broadcast from one element (stride 0 or 0-dim), both ways
        b0, a0 = pools[1][o], pools[0][o]
        yield "broadcast b", fn(args[0], b0.reshape(1).expand(n)), (None, o), idx
        yield "0-dim b", fn(args[0], b0.reshape(())), (None, o), idx
        yield "broadcast a", fn(a0.reshape(1, 1).expand(3, n), args[1][None].expand(3, n))[1], (o, None), idx
    if n > 1:  # a strided inner dim: [n // 2, 2] transposed
        m = (n // 2) * 2
        views = [a[:m].reshape(n // 2, 2).t() for a in args]
        yield "strided", fn(*views).t().reshape(-1), (None, None), idx[:m]


def _alone(fn, pools, fixed=(None, None)) -> torch.Tensor:
    """Element ``i`` of the pool(s) computed on its own (1-element tensors), for every ``i``;
    an operand named in ``fixed`` is held at that pool element."""
    def operand(k, i):
        j = i if fixed[k] is None else fixed[k]
        return pools[k][j:j + 1]
    return torch.cat([fn(*(operand(k, i) for k in range(len(pools)))) for i in range(POOL)])


def primitive_differences(name: str) -> list[str]:
    """The layouts in which ``name`` gives some element other bits than the element alone."""
    fn, kinds, dtype = PRIMITIVES[name]
    pools = [_pool(k, dtype) for k in kinds]
    tables: dict = {}
    bad = set()
    for n in LENGTHS:
        for offset in OFFSETS:
            for layout, got, fixed, idx in _layouts(fn, pools, n, offset):
                if layout in bad:
                    continue
                if fixed not in tables:
                    tables[fixed] = _raw(_alone(fn, pools, fixed))
                if not torch.equal(_raw(got), tables[fixed][idx]):
                    bad.add(layout)
    return sorted(bad)


def position_dependent(names=None) -> dict[str, list[str]]:
    """``{primitive: [layouts where an element's bits depend on its position]}``, only the bad ones."""
    out = {}
    for name in (PRIMITIVES if names is None else names):
        bad = primitive_differences(name)
        if bad:
            out[name] = bad
    return out


def bits_digest() -> dict[str, int]:
    """crc32 of each primitive's bits on its pool (element-wise alone): compare across sets."""
    out = {}
    for name, (fn, kinds, dtype) in PRIMITIVES.items():
        pools = [_pool(k, dtype) for k in kinds]
        res = _raw(_alone(fn, pools))
        out[name] = zlib.crc32(res.to(torch.int64).numpy().tobytes())
    return out


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_capability() -> str:
    """The kernel set this torch dispatches to (``torch.backends.cpu.get_cpu_capability()``), with
    torch 2.6's name for the generic set, ``"NO AVX"``, read as newer torch names it: ``"DEFAULT"``."""
    name = torch.backends.cpu.get_cpu_capability()
    return "DEFAULT" if name == "NO AVX" else name


def kernel_sets() -> list[str]:
    """The ``ATEN_CPU_CAPABILITY`` values below this CPU's best that can be forced here
    (native runs without the variable): ``avx2`` on an AVX-512 x86 CPU, and ``default``."""
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["default"]
    flags = _cpu_flags()
    native = cpu_capability()
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags or native == "AVX512"
    return (["avx2"] if avx512 and "avx2" in flags else []) + ["default"]


_CHILD = """
import json, torch
from tpinv.testing.kernel_sets import bits_digest, cpu_capability, position_dependent
print(json.dumps({"capability": cpu_capability(),
                  "position_dependent": position_dependent(), "digest": bits_digest()}))
"""


def run_in_kernel_set(capability: str | None, timeout: float = 600.0) -> dict:
    """:func:`position_dependent` and :func:`bits_digest` in a fresh interpreter with
    ``ATEN_CPU_CAPABILITY=capability`` (``None``: native) and ``OPENBLAS_CORETYPE=Haswell``
    for a forced set.  Returns ``{"capability", "position_dependent", "digest"}``."""
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
        env.setdefault("OPENBLAS_CORETYPE", "Haswell")
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"kernel-set check under ATEN_CPU_CAPABILITY={capability} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
