"""The Gluon kernel modules are imported once, on first use, through one loader; a Triton without
Gluon gives None (the Triton kernels then run, same bits), and a wrong module name is an error,
never taken for a missing Gluon."""
from __future__ import annotations

import importlib
import importlib.util
import types

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def test_loader_imports_once_and_keeps_the_module(monkeypatch):
    from tpinv.kernels import device
    monkeypatch.setattr(device, "_GLUON_MODULES", {})
    calls = []
    real = importlib.import_module

    def counting(name, *args):
        calls.append(name)
        return real(name, *args)

    # the loader's own imports only (importlib is shared: a global patch would count Triton's)
    monkeypatch.setattr(device, "importlib", types.SimpleNamespace(import_module=counting))
    first = device.gluon_module("triton_tree")       # any tpinv.kernels module: the loader is the same
    assert first is real("tpinv.kernels.triton_tree")
    assert device.gluon_module("triton_tree") is first
    assert calls == ["tpinv.kernels.triton_tree"]    # control: a second call imports nothing


def test_a_triton_without_gluon_gives_none(monkeypatch):
    from tpinv.kernels import device
    monkeypatch.setattr(device, "_GLUON_MODULES", {})

    def no_gluon(name, *args):
        raise ImportError("cannot import name 'gluon' from 'triton.experimental'", name="triton.experimental")

    monkeypatch.setattr(device, "importlib", types.SimpleNamespace(import_module=no_gluon))
    assert device.gluon_module("gluon_matmul") is None


def test_a_wrong_module_name_raises(monkeypatch):
    from tpinv.kernels import device
    monkeypatch.setattr(device, "_GLUON_MODULES", {})
    with pytest.raises(ModuleNotFoundError, match="tpinv.kernels.gluon_no_such_module"):
        device.gluon_module("gluon_no_such_module")
    assert "gluon_no_such_module" not in device._GLUON_MODULES
