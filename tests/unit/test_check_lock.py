"""tools/check_lock.py: the installed set must equal the lock, name and version."""
from __future__ import annotations

import pytest

from tpinv.testing.scripts import load_script

check_lock = load_script("tools/check_lock.py")


def test_same_set_passes_and_names_are_normalized():
    lock = check_lock.parse(["# header", "", "torch==2.13.0+cpu", "typing_extensions==4.16.0"], "lock")
    have = check_lock.parse(["torch==2.13.0+cpu", "Typing-Extensions==4.16.0"], "freeze")
    assert check_lock.difference(lock, have) == []


def test_every_kind_of_drift_is_printed():
    lock = check_lock.parse(["torch==2.13.0+cpu", "numpy==2.4.6", "gone==1.0"], "lock")
    have = check_lock.parse(["torch==2.13.0", "numpy==2.4.6", "extra==0.1"], "freeze")
    diff = check_lock.difference(lock, have)
    assert diff == ["  unlocked: extra==0.1 is installed but not in the lock",
                    "  missing: gone==1.0 is locked but not installed",
                    "  version: torch locked 2.13.0+cpu, installed 2.13.0"]


def test_bad_line_is_refused():
    with pytest.raises(SystemExit, match="lock:2: expected 'name==version'"):
        check_lock.parse(["numpy==2.4.6", "torch>=2.6"], "lock")


def test_the_lock_file_parses_and_pins_the_cpu_torch():
    pins = check_lock.parse(check_lock.LOCK.read_text().splitlines(), "constraints-cpu.txt")
    assert pins["torch"][1].endswith("+cpu")
    for name in ("numpy", "triton", "transformers", "megatron-core", "pytest", "hypothesis"):
        assert name in pins, name
