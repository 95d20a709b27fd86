"""Launching as clusters: an unknown launcher form is refused before launching; a launch is a
bound launch.

:class:`tpinv.kernels.cluster_launch.ClusteredKernel` changes one field of a compiled kernel's
launch metadata (the CTA count Triton's launcher turns into a cluster dimension).  Where that
metadata has another form, it raises a clear error instead of launching something else; control:
Triton 3.6's form passes the check (and then needs a driver, which a CPU machine lacks).  Its
launches take :func:`tpinv.kernels.launch.run_entry`, as bound launches do, and a recording of
launches sees them.
"""
from __future__ import annotations

import types

import pytest

from tpinv.kernels.cluster_launch import ClusteredKernel
from tpinv.kernels.launch import _direct_entry


def compiled_with(packed):
    return types.SimpleNamespace(packed_metadata=packed, function=0,
                                 metadata=types.SimpleNamespace(shared=0))


@pytest.mark.parametrize("packed", [None, (4, 2, 1024), (4, 1), [4, 1, 1024]])
def test_an_unknown_launch_metadata_form_is_refused(packed):
    kernel = types.SimpleNamespace(arg_names=["x"])
    with pytest.raises(RuntimeError, match="launcher form"):
        ClusteredKernel(kernel, compiled_with(packed), 8)


def test_control_triton_3_6_s_form_passes_the_check():
    kernel = types.SimpleNamespace(arg_names=["x"])
    try:
        ClusteredKernel(kernel, compiled_with((4, 1, 1024)), 8)
    except RuntimeError as exc:
        assert "launcher form" not in str(exc)
    except Exception:   # past the check: no GPU driver here (or no Triton)
        pass


class _Launcher:
    """A compiled kernel's launcher stand-in (not Triton's ``CudaLauncher``: no C entry is taken
    from it) that notes its calls."""
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _kernel_without_driver():
    """A ClusteredKernel over a stand-in compiled kernel (``__init__`` asks a GPU driver for the
    clusters' occupancy), kept as ``__init__`` keeps it."""
    compiled = types.SimpleNamespace(run=_Launcher(), function="f", packed_metadata=(4, 8, 1024),
                                     launch_metadata=lambda *a: "metadata")
    clustered = object.__new__(ClusteredKernel)
    kernel = types.SimpleNamespace(__name__="k", arg_names=["x", "y", "N"])
    clustered.compiled, clustered.cluster_size = compiled, 8
    clustered.entry = (compiled, (7,), _direct_entry(compiled), kernel)   # N=7: the tail
    return clustered


def test_a_cluster_launch_is_a_bound_launch(monkeypatch):
    """A cluster launch runs its compiled kernel's launcher with the cluster's launch metadata
    (``num_ctas`` = the cluster size: the launcher's cluster dimension), the constexpr tail
    appended, on the current stream; a running recording of launches is told of it as of any bound
    launch (with the entry it can replay).  Control: with no recording, the launch alone."""
    from tpinv.kernels import launch
    monkeypatch.setattr(launch, "_GETTERS", [lambda: 0, lambda device: 77])
    monkeypatch.setattr(launch, "_hooks", lambda: (None, None))
    told = []
    recorder = types.SimpleNamespace(launch=lambda entry, grid, full: told.append((entry, grid, full)))
    clustered = _kernel_without_driver()
    assert clustered.entry[2] is None          # a stand-in launcher has no C entry: through it
    assert launch.RECORDER[0] is None
    launch.RECORDER[0] = recorder             # as a Recording sets it while it runs
    try:
        clustered.launch(3, ("a", "b"))
    finally:
        launch.RECORDER[0] = None
    assert told == [(clustered.entry, (3, 1, 1), ("a", "b", 7))]
    clustered.launch(2, ("a", "b"))
    assert len(told) == 1
    assert clustered.compiled.run.calls == [
        (3, 1, 1, 77, "f", (4, 8, 1024), None, None, None, "a", "b", 7),
        (2, 1, 1, 77, "f", (4, 8, 1024), None, None, None, "a", "b", 7)]
