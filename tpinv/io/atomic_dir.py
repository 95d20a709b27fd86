"""Atomic output directories: a directory appears under its final name complete, or not at all.

Everything is written into ``OUT_DIR.tmp-XXXX`` beside the target; files and the directory
are fsynced, and one ``rename`` gives it its final name.  An exception removes the temporary
directory; a killed process leaves only a directory whose name ends in ``.tmp-XXXX``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_directory(out_dir: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a fresh ``OUT_DIR.tmp-XXXX`` beside ``out_dir``; rename it to ``out_dir`` on success.

    On any exception the temporary directory is removed and ``out_dir`` is left as it was.
    With ``overwrite=True`` an existing ``out_dir`` is replaced only after the new one is complete.
    """
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; pass overwrite=True (--overwrite) to replace it")
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    except OSError as e:
        raise OSError(f"cannot write the output directory {out_dir}: {e.strerror} ({e.filename})") from None
    try:
        yield tmp
        publish_directory(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_directory(tmp: str, out_dir: str) -> None:
    """fsync the complete directory ``tmp`` and rename it to ``out_dir`` (an existing one is replaced
    only once the new one is in place); ``tmp`` must sit beside ``out_dir``."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    fsync_dir(tmp)
    old = None
    if os.path.exists(out_dir):
        old = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".old-", dir=parent)
        os.rename(out_dir, os.path.join(old, "replaced"))
    os.rename(tmp, out_dir)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old)


def fsync_file(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        fsync_file(f)


def copy_file(src: str, dst_dir: str) -> None:
    """Copy ``src`` into ``dst_dir`` and fsync the copy."""
    dst = os.path.join(dst_dir, os.path.basename(src))
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        fsync_file(f)
