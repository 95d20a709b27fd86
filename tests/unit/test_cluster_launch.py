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
