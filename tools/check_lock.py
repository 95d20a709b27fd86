"""Check that the installed packages are exactly the lock: ``constraints-cpu.txt``.

The lock pins every package that the README's CPU install resolves (name and version as
``pip freeze --exclude-editable`` prints them, e.g. ``torch==2.13.0+cpu``), so a clone made
later installs the same set.  This check runs after that install (``.ci/run``) and fails,
printing the difference, when the installed set drifts from the lock: a package missing, one
not in the lock, or another version.

Refresh the lock (after changing ``setup.cfg``'s requirements, or to move to newer versions):
in a fresh venv, install as the README says but without ``-c constraints-cpu.txt`` (or with
the pins you mean to change edited), then run ``python tools/check_lock.py --write`` with
that venv's python.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

LOCK = Path(__file__).resolve().parent.parent / "constraints-cpu.txt"
HEADER = """\
# The lock for the CPU install used by the README and CI: every package that
# `pip install -c constraints-cpu.txt -e ".[test]"` resolves, as `pip freeze --exclude-editable`
# prints it (torch is PyTorch's CPU wheel, spelled `2.13.0+cpu`).  `.ci/run` checks the
# installed set against this file with `python tools/check_lock.py`.  To refresh: in a fresh
# venv, `pip install -e ".[test]"`, then `python tools/check_lock.py --write` with its python.
"""
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-``, ``_`` and ``.`` become one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(lines: list[str], where: str) -> dict[str, tuple[str, str]]:
    """``{normalized name: (name, version)}`` from ``name==version`` lines; comments skipped."""
    pins: dict[str, tuple[str, str]] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN.match(line)
        if not match:
            raise SystemExit(f"check_lock: {where}:{number}: expected 'name==version', got {raw.strip()!r}")
        pins[normalize(match.group(1))] = (match.group(1), match.group(2))
    return pins


def installed() -> list[str]:
    """``pip freeze --exclude-editable`` of this interpreter (the project itself is editable)."""
    out = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def difference(lock: dict, have: dict) -> list[str]:
    """One line per package whose presence or version differs; empty when they agree."""
    lines = []
    for key in sorted(set(lock) | set(have)):
        if key not in have:
            lines.append(f"  missing: {lock[key][0]}=={lock[key][1]} is locked but not installed")
        elif key not in lock:
            lines.append(f"  unlocked: {have[key][0]}=={have[key][1]} is installed but not in the lock")
        elif lock[key][1] != have[key][1]:
            lines.append(f"  version: {lock[key][0]} locked {lock[key][1]}, installed {have[key][1]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lock", type=Path, default=LOCK, help="the lock file (default: %(default)s)")
    parser.add_argument("--write", action="store_true", help="rewrite the lock from the installed set")
    args = parser.parse_args(argv)
    have = parse(installed(), "pip freeze")
    if args.write:
        body = "".join(f"{name}=={version}\n" for name, version in sorted(have.values(), key=lambda p: normalize(p[0])))
        args.lock.write_text(HEADER + body)
        print(f"check_lock: wrote {len(have)} pins to {args.lock}")
        return 0
    lock = parse(args.lock.read_text().splitlines(), str(args.lock))
    diff = difference(lock, have)
    if diff:
        print(f"check_lock: the installed packages differ from {args.lock.name} ({len(diff)}):", file=sys.stderr)
        print("\n".join(diff), file=sys.stderr)
        print("check_lock: install with -c constraints-cpu.txt in a fresh venv, or refresh the lock "
              "(see tools/check_lock.py)", file=sys.stderr)
        return 1
    print(f"check_lock: {len(lock)} installed packages match {args.lock.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
