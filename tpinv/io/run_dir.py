"""Run directories: one writer at a time, and no run silently writes over another run's checkpoints.

A run that saves into ``ROOT`` first calls :func:`claim_run_dir`, which

* creates ``ROOT`` and proves it writable (a probe file), so a bad ``--save`` fails before any step;
* takes the exclusive lock ``ROOT/.lock`` (created with ``O_EXCL``; it holds the owner's pid,
  host, run id and start time).  A lock whose pid is dead on this host is stale and taken
  over; a live owner's lock refuses the second writer, naming the owner;
* refuses a *fresh* run (no resume) into a ``ROOT`` that already holds checkpoints (a
  ``latest`` file or ``step_*`` directories) unless ``overwrite=True``, which first moves the
  old checkpoints out of the way and removes them;
* removes the temporary directories a killed save left behind (``step_*.tmp-*``, ``*.old-*``,
  ``latest.tmp-*``): while the lock is held no other writer can be producing them.

The lock is released by :meth:`RunLock.release` (the trainer does so when the run ends).  One
process holds one lock per directory: a lock naming this very pid is treated as its own.
"""
from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import uuid
from typing import Optional

__all__ = ["RunDirError", "RunLock", "claim_run_dir", "clean_stale_temps", "is_training_checkpoint", "new_run_id",
           "LATEST_FILE", "LOCK_FILE", "STATE_FILE"]

_log = logging.getLogger("tpinv.io.run_dir")

LOCK_FILE = ".lock"
#: A training checkpoint's step directory holds ``STATE_FILE``; its root names the newest step in ``LATEST_FILE``.
STATE_FILE, LATEST_FILE = "train_state.json", "latest"
_STEP = re.compile(r"^step_\d+$")
_TEMP = re.compile(r"^(step_\d+\.(tmp|old)-.+|latest\.tmp-.+|\.overwritten-.+|\.lock\.stale-.+)$")


class RunDirError(RuntimeError):
    """A checkpoint directory cannot be used by this run (locked, another run's, not writable)."""


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_lock(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # being written or damaged: treated as held by an unknown owner


class RunLock:
    """The exclusive lock of one run directory (see the module docstring)."""

    def __init__(self, root: str, run_id: str):
        self.root, self.run_id = os.path.abspath(root), run_id
        self.path = os.path.join(self.root, LOCK_FILE)
        self.held = False

    def acquire(self) -> "RunLock":
        me = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": self.run_id,
              "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = _read_lock(self.path)
                if owner is None:
                    continue  # released meanwhile: try again
                if self._stale(owner):
                    self._break(owner)
                    if owner.get("pid") != os.getpid():
                        _log.warning("%s: took over the lock of run %s (pid %s, since %s), which is no longer "
                                     "running", self.root, owner.get("run_id", "?"), owner.get("pid", "?"),
                                     owner.get("since", "?"))
                    continue
                raise RunDirError(
                    f"{self.root} is being written by another run (pid {owner.get('pid', '?')} on host "
                    f"{owner.get('host', '?')}, run {owner.get('run_id', '?')}, since {owner.get('since', '?')}); "
                    f"a second writer is refused: use another --save directory, or wait for that run to end "
                    f"(if it is dead on another host, remove {self.path})")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return self
        raise RunDirError(f"{self.path}: could not take the lock (it keeps changing hands)")

    def _stale(self, owner: dict) -> bool:
        if not owner or owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
            return False  # another host's (or an unreadable) lock: its pid cannot be checked from here
        return owner["pid"] == os.getpid() or not _pid_alive(owner["pid"])

    def _break(self, owner: dict) -> None:
        """Move a stale lock aside atomically (only one breaker wins the rename), then drop it."""
        aside = f"{self.path}.stale-{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if _read_lock(aside) != owner:  # someone else's fresh lock was moved: put it back
            try:
                os.rename(aside, self.path)
            except OSError:
                pass
            return
        os.unlink(aside)

    def release(self) -> None:
        if self.held and (_read_lock(self.path) or {}).get("pid") == os.getpid():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.held = False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _check_writable(root: str) -> None:
    try:
        os.makedirs(root, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason = "permission denied" if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else e.strerror
        raise RunDirError(f"--save {root} is not writable ({reason}); nothing was trained") from None


def clean_stale_temps(root: str) -> list[str]:
    """Remove what interrupted saves left in ``root``; returns the names removed (call with the lock held)."""
    removed = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        if _TEMP.match(name):
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
            removed.append(name)
    return removed


def is_training_checkpoint(path: str) -> bool:
    """Whether ``path`` is a training checkpoint: a step directory (``STATE_FILE``) or a run's root
    (``LATEST_FILE``).  It is not a model directory: ``tools/export_checkpoint.py`` makes one of it."""
    return os.path.isfile(os.path.join(path, STATE_FILE)) or os.path.isfile(os.path.join(path, LATEST_FILE))


def existing_checkpoints(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if _STEP.match(n) or n == LATEST_FILE)


def claim_run_dir(root: str, *, run_id: str, resume: bool, overwrite: bool) -> RunLock:
    """Check and lock ``root`` for a run; see the module docstring.  Raises :class:`RunDirError`."""
    root = os.path.abspath(root)
    _check_writable(root)
    lock = RunLock(root, run_id).acquire()
    try:
        old = existing_checkpoints(root)
        if old and not resume:
            if not overwrite:
                steps = [n for n in old if n != LATEST_FILE]
                raise RunDirError(f"--save {root} already holds another run's checkpoints ({len(steps)} step "
                                  f"directories{', latest ' + steps[-1] if steps else ''}); pass --load {root} to "
                                  f"resume that run, --overwrite to replace it, or choose another directory")
            trash = tempfile.mkdtemp(prefix=".overwritten-", dir=root)
            for name in old:
                os.rename(os.path.join(root, name), os.path.join(trash, name))
            shutil.rmtree(trash)
        clean_stale_temps(root)
    except BaseException:
        lock.release()
        raise
    return lock
