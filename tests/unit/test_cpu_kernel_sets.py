"""Every CPU primitive on an invariant path is position independent under every kernel set.

The same values sit at offsets 0..17 of lengths 1..70 (so each lands in vector bodies and in
scalar tails), as slices, beside broadcast operands and in strided views; each element must
have the bits of the element computed alone (``tpinv.testing.kernel_sets``).  This runs in
process (the native set) and in one subprocess per forced ``ATEN_CPU_CAPABILITY`` (the set
is read once, when torch is imported).  Negative controls: the checker flags ``torch.sigmoid``
(AVX-512/AVX2: vector body and scalar tail round differently) and, on every set, an op whose
bits depend on the position by construction (a running sum along the tensor).
"""
from __future__ import annotations

import platform

import pytest
import torch

from tpinv.testing.kernel_sets import PRIMITIVES, cpu_capability, kernel_sets as forced_sets, position_dependent, \
    primitive_differences, run_in_kernel_set


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_primitive_position_independent_native(name):
    assert primitive_differences(name) == [], f"{name} depends on the element's position"


def test_checker_catches_a_position_dependent_op(monkeypatch):
    # By construction on every set: element i of a cumulative sum depends on elements < i.
    monkeypatch.setitem(PRIMITIVES, "cumsum", (lambda x: torch.cumsum(x, 0), ("signed",), torch.float32))
    assert "slice" in position_dependent(["cumsum"])["cumsum"]


def test_checker_catches_sigmoid_where_its_paths_differ(monkeypatch):
    monkeypatch.setitem(PRIMITIVES, "sigmoid", (torch.sigmoid, ("signed",), torch.float32))
    bad = primitive_differences("sigmoid")
    capability = cpu_capability()
    if capability in ("AVX512", "AVX2"):
        assert "slice" in bad
    elif capability == "DEFAULT" and platform.machine().lower() in ("x86_64", "amd64"):
        assert bad == []  # x86's generic set runs one scalar formula for every element
    else:
        pytest.skip(f"no known sigmoid behaviour on {capability} ({platform.machine()})")


@pytest.mark.slow
@pytest.mark.parametrize("capability", forced_sets())
def test_primitives_position_independent_under_forced_set(capability):
    result = run_in_kernel_set(capability)
    assert result["capability"].lower() == capability, \
        f"ATEN_CPU_CAPABILITY={capability} did not take effect (got {result['capability']})"
    assert result["position_dependent"] == {}
    assert set(result["digest"]) == set(PRIMITIVES)

