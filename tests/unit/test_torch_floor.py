"""``import tpinv`` refuses a torch below :data:`tpinv.TORCH_FLOOR`, naming both versions.

The real import path is checked in a child interpreter whose ``torch.__version__`` is set to
an older release before ``import tpinv`` (no old torch is installed); the control is the same
child with the installed version, which imports.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tpinv

REPO = Path(__file__).resolve().parents[2]


def _import_with_torch_version(version: str | None) -> subprocess.CompletedProcess:
    """``import tpinv`` in a child whose ``torch.__version__`` is ``version`` (None: as installed)."""
    pretend = f"torch.__version__ = {version!r}\n" if version else ""
    code = "import torch\n" + pretend + "import tpinv\nprint('imported')"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_floor_matches_setup_cfg():
    """setup.cfg's ``torch>=`` is the floor the import enforces."""
    text = (REPO / "setup.cfg").read_text()
    need = ".".join(map(str, tpinv.TORCH_FLOOR))
    assert f"torch>={need}\n" in text, f"setup.cfg does not say torch>={need}"


@pytest.mark.parametrize("version", ["2.5.1", "2.5.0+cu124", "1.13.1", "garbage"])
def test_older_torch_refused_with_both_versions(version):
    with pytest.raises(ImportError) as err:
        tpinv._require_torch(version)
    need = ".".join(map(str, tpinv.TORCH_FLOOR))
    assert f"torch >= {need}" in str(err.value) and f"torch {version} is installed" in str(err.value)


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0+cu124", "2.13.0+cpu", "2.15.0", "2.16.0a0+git1234", "3.0.0"])
def test_floor_and_newer_accepted(version):
    tpinv._require_torch(version)


def test_import_refuses_an_older_torch():
    major, minor = tpinv.TORCH_FLOOR
    below = f"{major}.{minor - 1}.1" if minor else f"{major - 1}.99.0"
    old = _import_with_torch_version(below)
    assert old.returncode != 0 and "imported" not in old.stdout
    assert f"ImportError: tpinv needs torch >= {major}.{minor}, but torch {below} is installed" in old.stderr, \
        old.stderr
    control = _import_with_torch_version(None)   # the installed torch: the same child imports
    assert control.returncode == 0 and control.stdout.strip() == "imported", control.stderr
