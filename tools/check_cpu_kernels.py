#!/usr/bin/env python3
"""Check this machine's CPU kernel sets: are the invariant paths' primitives position independent?

For the native set and each set ``ATEN_CPU_CAPABILITY`` can force here (``avx2``, ``default``
on x86; ``default`` on ARM), a fresh interpreter runs every primitive of
:data:`tpinv.testing.kernel_sets.PRIMITIVES` on the same values at offsets 0..17 of lengths
1..70 (vector bodies and scalar tails), beside broadcast operands and in strided views, and
compares each element with the element computed alone.  It also hashes each primitive's bits,
so the report says whether the sets give the same bits as each other (not required by the
contract, which holds within one set).  ``--tests`` then runs the invariance-critical test
files under each set.  Exits 1 if a primitive is position dependent or a test fails.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

#: The invariance-critical test files (the ones CI also runs under forced kernel sets).
CRITICAL_TESTS = [f"tests/unit/test_{name}.py" for name in (
    "cpu_kernel_sets", "elementwise_primitives", "activation", "rope", "norm", "softmax", "attention_op",
    "attention_fwd", "attention_bwd", "models", "engine", "training_units", "matmul")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sets", default=None,
                   help="comma-separated ATEN_CPU_CAPABILITY values to force (default: the ones this CPU allows)")
    p.add_argument("--tests", action="store_true", help="also run the invariance-critical tests under each set")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from tpinv.testing.kernel_sets import PRIMITIVES, kernel_sets, run_in_kernel_set
    args = parse_args(argv)
    sets = [None] + (kernel_sets() if args.sets is None else [s for s in args.sets.split(",") if s])
    results, ok = {}, True
    for cap in sets:
        label = cap or "native"
        t0 = time.time()
        print(f"== {label}: {len(PRIMITIVES)} primitives, lengths 1..70 x offsets 0..17 ...", flush=True)
        res = run_in_kernel_set(cap)
        results[label] = res
        bad = res["position_dependent"]
        ok &= not bad
        print(f"   kernels {res['capability']}: "
              + ("position independent" if not bad else f"POSITION DEPENDENT: {bad}")
              + f" ({time.time() - t0:.0f} s)", flush=True)
    native = results["native"]["digest"]
    for label, res in results.items():
        if label == "native":
            continue
        differ = sorted(k for k in native if res["digest"].get(k) != native[k])
        print(f"== bits {label} ({res['capability']}) vs native ({results['native']['capability']}): "
              + ("the same for every primitive" if not differ else f"differ for {differ}"))
    if args.tests:
        for cap in sets:
            env = dict(os.environ)
            env.pop("ATEN_CPU_CAPABILITY", None)
            if cap is not None:
                env.update(ATEN_CPU_CAPABILITY=cap, OPENBLAS_CORETYPE="Haswell")
            print(f"== tests under {cap or 'native'}", flush=True)
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "not slow", *CRITICAL_TESTS],
                                 env=env, cwd=root)
            ok &= rc == 0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
