"""Launching as clusters refuses a Triton whose launcher it does not know, before launching.

:class:`tpinv.kernels.cluster_launch.ClusteredKernel` changes one field of a compiled kernel's
launch metadata (the CTA count Triton's launcher turns into a cluster dimension).  Where that
metadata has another form, it raises a clear error instead of launching something else; control:
Triton 3.6's form passes the check (and then needs a driver, which a CPU machine lacks).
"""
from __future__ import annotations

import types

import pytest

from tpinv.kernels.cluster_launch import ClusteredKernel


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


class _Compiled:
    """A compiled kernel's stand-in that notes its launches."""
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


def _kernel_without_driver():
    clustered = object.__new__(ClusteredKernel)       # __init__ asks a GPU driver for occupancy
    clustered.compiled, clustered.cluster_size = _Compiled(), 8
    clustered.names, clustered.kernel = ["x", "y", "N"], types.SimpleNamespace(__name__="k")
    return clustered


def test_a_recording_is_told_of_a_cluster_launch(monkeypatch):
    """A recorded program replays bound launches only; a cluster launch inside a recording makes
    it refuse (``unbound``) rather than leave the launch out of the program.  Control: with no
    recording the launch alone happens.  Both launch, with the constexpr tail appended."""
    from tpinv.kernels import launch
    told = []
    recorder = types.SimpleNamespace(unbound=lambda fn: told.append(fn.__name__))
    clustered = _kernel_without_driver()
    monkeypatch.setattr(launch, "RECORDER", [recorder])
    clustered.launch(3, ("a", "b"), {"N": 7})
    assert told == ["k"]
    monkeypatch.setattr(launch, "RECORDER", [None])
    clustered.launch(2, ("a", "b"), {"N": 7})
    assert told == ["k"]
    assert clustered.compiled.launches == [((3, 1, 1), ("a", "b", 7)), ((2, 1, 1), ("a", "b", 7))]
