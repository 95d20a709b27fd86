"""Run a test module's ``check_*`` functions under Triton's interpreter, in one child process.

The interpreter is switched on by ``TRITON_INTERPRET=1`` before triton is first imported, and
other test modules of the same pytest process may already have imported triton for real; so
a module hands its checks to :func:`interpreted_test`, which runs the module file as a script
with the interpreter on (the script prints :func:`run_checks`' outcomes as one JSON line) and
returns a pytest test over the check names.  A check passes when it returns; its traceback is
the failure message otherwise.

The interpreter stands in for the GPU, and the kernels rely on one property of the GPU's dot: an
output row's bits do not depend on the row's place in the tile (a tensor-core MMA computes every
element the same way; ``tests/gpu`` checks it on the device).  The interpreter's own ``tl.dot`` is
numpy's matmul, whose BLAS need not have it: OpenBLAS's Haswell sgemm (``OPENBLAS_CORETYPE=Haswell``)
gives a row different bits at different tile rows.  So the child process replaces the interpreter's
dot with a fixed-order one (:func:`fixed_order_dot`): each output element is the contiguous
halving sum of its ``K`` fp32 products, the same on every machine and at every row and column.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]


#: Triton below this fails under numpy >= 2.4 with "only 0-dimensional arrays can be converted to
#: Python scalars" (its interpreter makes ``tl.program_id``, a one-element array, a Python int): seen
#: on 3.2.0, 3.3.1, 3.4.0, 3.5.1 and 3.6.0; 3.9.0 runs; 3.7 and 3.8 were not tried (docs/versions.md).
NUMPY_2_4_TRITON = (3, 7)
CLASH_ERROR = "only 0-dimensional arrays can be converted to Python scalars"


def _release(dist: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version(dist))
    return tuple(map(int, found.groups())) if found else (0, 0)


def interpreter_clash() -> Optional[str]:
    """Why this Triton's interpreter cannot run with this numpy, or None."""
    try:
        triton, numpy = _release("triton"), _release("numpy")
    except importlib.metadata.PackageNotFoundError:
        return None
    if triton < NUMPY_2_4_TRITON and numpy >= (2, 4):
        return (f"Triton {'.'.join(map(str, triton))}'s interpreter fails with numpy >= 2.4 (tl.program_id as a "
                f"one-element array); numpy {'.'.join(map(str, numpy))} is installed: pin numpy < 2.4 "
                f"(constraints-floor.txt does) to run the interpreter tests")
    return None


def checks_of(namespace: dict) -> dict[str, Callable[[], None]]:
    """The ``check_*`` functions of a module namespace, by name."""
    return {name: fn for name, fn in namespace.items() if name.startswith("check_") and callable(fn)}


def seeded_checks(namespace: dict, setup: Callable[[], None] | None = None) -> dict[str, Callable[[], None]]:
    """The ``check_*`` functions of a module namespace, each run after ``torch.manual_seed(0)``
    (and ``setup()``, if given)."""
    def seeded(check):
        def run():
            import torch
            torch.manual_seed(0)
            if setup is not None:
                setup()
            check()
        return run
    return {name: seeded(fn) for name, fn in checks_of(namespace).items()}


def halving_sum(x, axis: int):
    """numpy: the contiguous halving sum of ``x`` over ``axis`` (zero-padded to a power of two;
    element ``i`` meets ``i + h``), the order of :func:`tpinv.kernels.reference_attention.halve`."""
    import numpy as np
    x = np.moveaxis(x, axis, -1)
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (width - n,), dtype=x.dtype)], axis=-1)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def fixed_order_dot(a, b, acc):
    """``acc + a @ b`` (numpy, ``[..., M, K] @ [..., K, N]``) in ``acc``'s dtype: each element the
    :func:`halving_sum` of its ``K`` products, so no element depends on its row's or column's place."""
    x = a.astype(acc.dtype)[..., :, :, None]
    y = b.astype(acc.dtype)[..., None, :, :]
    return halving_sum(x * y, -2) + acc


def use_fixed_order_dot() -> None:
    """Make the interpreter's ``tl.dot`` :func:`fixed_order_dot` (this process; float inputs of
    16 bits and more, the only ones the tests use: 8-bit floats are refused with a clear error)."""
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "fixed_order", False):
        return

    def create_dot(self, a, b, d, *_):
        if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating() or \
                b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating():
            raise NotImplementedError("the tests' fixed-order interpreter dot takes no 8-bit floats")
        return interpreter.TensorHandle(fixed_order_dot(a.data, b.data, d.data), d.dtype.scalar)

    create_dot.fixed_order = True
    builder.create_dot = create_dot


def patch_language_once() -> None:
    """Let the interpreter patch ``triton.language`` once per kernel launch, not again at every
    device-function call (this process; speed only).

    The interpreter swaps ``triton.language``'s builtins for interpreted ones when a kernel
    launches (Triton 3.9: undone when the launch ends; 3.2: never undone) and does it again at
    each device-function call, walking the whole module with ``inspect.getmembers`` each time.
    Those repeats set the same attributes to equivalent values: about 40% of a check's time in
    a profile under 3.9, nothing else.  A call whose modules (``tl``, ``tl.core``) are all
    patched already skips; a launch's undoing forgets what was patched, so the next launch
    patches again.  Where the interpreter has no ``_patch_lang`` this does nothing.
    """
    from triton.runtime import interpreter
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "once", False):
        return
    lang = interpreter.tl
    patched: set = set()   # the language modules patched now

    class _NothingToUndo:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        mods = {v for v in fn.__globals__.values() if v is lang or v is lang.core}
        if mods and mods <= patched:
            return _NothingToUndo()
        scope = original(fn)
        patched.update(mods)
        undo = getattr(scope, "restore", None)
        if undo is not None:
            def restore() -> None:
                undo()
                patched.clear()
            scope.restore = restore
        return scope

    patch_lang.once = True
    interpreter._patch_lang = patch_lang


def run_checks(checks: dict[str, Callable[[], None]]) -> dict[str, str]:
    """Child side: ``{name: "ok" or the traceback}``, with the interpreter's dot :func:`fixed_order_dot`
    (and its language patched once a launch: :func:`patch_language_once`)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    use_fixed_order_dot()
    patch_language_once()
    results = {}
    for name, fn in checks.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:  # reported to the parent test, which fails with it
            results[name] = traceback.format_exc()
    return results


def _outcomes(module_file: str, names: tuple[str, ...] = ()) -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(Path(module_file).resolve()), *names], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1])


def interpreted_test(module_file: str, checks: dict[str, Callable[[], None]], *,
                     process_per_check: bool = False) -> Callable:
    """A pytest test, one case per check, that runs ``module_file`` once under the interpreter
    (or once per check with ``process_per_check``: long checks then spread over pytest workers)."""
    cache: dict[str, dict[str, str]] = {}

    @pytest.mark.parametrize("name", sorted(checks))
    def test_interpreted(name):
        if process_per_check:
            cache["outcomes"] = _outcomes(module_file, (name,))
        elif not cache:
            cache["outcomes"] = _outcomes(module_file)
        outcome = cache["outcomes"].get(name, f"check {name} did not run")
        clash = interpreter_clash()
        last = outcome.strip().splitlines()[-1]
        if clash and last.startswith("triton.runtime.errors.InterpreterError") and CLASH_ERROR in last:
            pytest.skip(f"{name} raised the interpreter's numpy error: {clash}")
        assert outcome == "ok", f"{name} failed under TRITON_INTERPRET=1:\n{outcome}"

    return test_interpreted


def main(checks: dict[str, Callable[[], None]]) -> None:
    """Child side entry point: run the checks named on the command line (default all) and
    print the outcomes as one JSON line."""
    names = sys.argv[1:] or list(checks)
    print(json.dumps(run_checks({name: checks[name] for name in names})))
