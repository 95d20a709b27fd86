"""Spawned multi-rank groups for tests: :func:`run_ranks` starts one fresh process per rank,
joins them into a process group, runs a module-level function in each and returns the results
in rank order; it never hangs (every wait has a deadline) and a failing rank's full traceback
is raised in the caller.

The rendezvous store is the caller's: :func:`run_ranks` opens a TCP store on a port the kernel
picks and holds it until the ranks are gone, and every rank (rank 0 too) joins it as a client,
as under ``torchrun``'s agent.  No port is picked, released and bound again later, so two runs
at once (pytest-xdist workers) can never meet on one port.

Each rank is a fresh process either way: on Linux it is forked from a fork server (a clean
interpreter, started once per calling process, that has imported torch, tpinv and -- where the
caller has -- the model zoo and megatron-core), not exec'ed and made to import them again (about
2 s of CPU a rank, 5 s more with megatron-core).  The rank gets the caller's environment as of
the call.  Where the caller's environment differs from the one the fork server started in (other
than pytest's per-test variable), a setting read at import time could differ, so the ranks are
spawned as before; ``TPINV_RANKS_START=spawn`` always spawns."""
from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["RankFailedError", "RankTimeoutError", "caught", "free_port", "run_ranks"]

# Seconds a dead rank's last message may still take to arrive through the result pipe.
_DRAIN_SECONDS = 1.0
# Seconds ranks that all returned a result get to exit by themselves (tearing down their group and
# the helper processes they started, e.g. megatron-core's checkpoint writers) before being killed.
_EXIT_GRACE_SECONDS = 10.0
_POLL_SECONDS = 0.05
# A rank alive this many seconds before the deadline dumps its stacks (the caller kills it then).
_STACK_DUMP_LEAD = 3.0
_HOST = "127.0.0.1"
#: Modules the fork server imports where the caller has imported them (the heavy imports a rank
#: makes anyway).
_PRELOAD = ("torch", "torch.distributed", "tpinv", "tpinv.layers", "models", "megatron.core")
#: Variables that change within one caller without changing what an import does.
_VOLATILE_ENV = ("PYTEST_CURRENT_TEST", )
_SERVER_ENV: list = []   # the caller's environment when this process started the fork server


class RankFailedError(RuntimeError):
    """A spawned rank raised (its traceback is in the message) or died without a result.

    ``results`` maps the ranks that did return to their results.
    """

    def __init__(self, message: str, results: dict[int, Any] | None = None) -> None:
        super().__init__(message)
        self.results = dict(results or {})


class RankTimeoutError(TimeoutError):
    """Spawned ranks did not finish within the time limit."""


def free_port() -> int:
    """A TCP port on the loopback address that was free a moment ago (:func:`run_ranks` holds
    its own; this is for launchers such as ``torchrun`` that bind the port themselves).

    Drawn at random below the kernel's ephemeral range: a launcher binds it seconds later (after
    importing torch), and a port the kernel hands out itself (gloo's connections in a parallel
    test worker take many) could be taken in between; one below that range never is."""
    low = _ephemeral_low()
    draw = random.Random(os.urandom(8))
    for _ in range(200 if low > _LOWEST_PORT else 0):   # no unprivileged port below the range: any free one
        port = draw.randrange(max(_LOWEST_PORT, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((_HOST, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # every draw taken: any free one
        s.bind((_HOST, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default, 32768, elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_LOWEST_PORT = 1024   # the first port an unprivileged process may bind


def _stable_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE_ENV}


def _start_context():
    """The fork server's context where a rank forked from it starts as a spawned one would (see
    the module docstring), else spawn's."""
    if os.environ.get("TPINV_RANKS_START") == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    env = _stable_env()
    ctx = mp.get_context("forkserver")
    if not _SERVER_ENV:
        ctx.set_forkserver_preload([m for m in _PRELOAD if m in sys.modules])
        _SERVER_ENV.append(env)
    return ctx if env == _SERVER_ENV[0] else mp.get_context("spawn")


class _CallerStdio:
    """The caller's stdout and stderr as they are at the call, for a rank the fork server starts
    (a spawned rank inherits them): pickled as duplicates of file descriptors 1 and 2."""

    def __reduce__(self):
        from multiprocessing import reduction
        return (_stdio_fds, (reduction.DupFd(1), reduction.DupFd(2)))


def _stdio_fds(out, err) -> tuple:
    return out, err


def _rank_main(fn, rank, world_size, args, backend, port, pg_timeout, env, threads, init_group,
               results, deadline, caller=None) -> None:
    """Body of one rank: set up, run ``fn``, send ``(rank, ok, payload)`` back."""
    if caller is not None:   # forked from the fork server: the caller's environment and stdio now
        caller_env, stdio = caller
        os.environ.clear()
        os.environ.update(caller_env)
        for target, fd in zip((1, 2), stdio):
            fd = fd.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
    # A rank still running shortly before the caller's deadline (CLOCK_MONOTONIC is shared by
    # all processes) prints every thread's stack to stderr, so a timeout says where it hung.
    faulthandler.dump_traceback_later(max(deadline - time.monotonic() - _STACK_DUMP_LEAD, 0.1))
    try:
        # TORCHELASTIC_USE_AGENT_STORE: every rank's env:// or tcp:// rendezvous is a client of
        # the store the parent holds at MASTER_PORT (rank 0 does not host one); older torch
        # releases also read the restart count for the store's key prefix.
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                           "MASTER_ADDR": _HOST, "MASTER_PORT": str(port),
                           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"})
        os.environ.update(env or {})
        if threads is not None:
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if init_group:
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    init_method="env://",
                                    timeout=datetime.timedelta(seconds=pg_timeout))
        payload = pickle.dumps(fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        # Report first: tearing down a group whose peers are stuck may block.
        _send(results, (rank, False, traceback.format_exc()))
        return
    _send(results, (rank, True, payload))
    if dist.is_initialized():
        dist.destroy_process_group()


def _send(results, message) -> None:
    """Put ``message`` and wait until it is in the pipe.  The queue's feeder thread writes it, and
    a teardown that blocks while holding the GIL would otherwise keep it from ever leaving: seen
    with torch 2.6 and gloo in about one run of 20 (three ranks, a loaded two-core machine), the
    rank's main thread in ``destroy_process_group`` and its feeder thread waiting for the GIL."""
    results.put(message)
    results.close()
    results.join_thread()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 120.0, env: dict[str, str] | None = None,
              pg_timeout: float | None = None, threads: int | None = 1,
              init_group: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; results in rank order.

    ``fn`` must be a module-level function and its arguments and result picklable
    (tensors are copied).  Each rank sets ``torch.set_num_threads(threads)`` (skip with
    ``threads=None``), the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT), then ``env``, and joins a ``backend`` process group over TCP whose
    collective timeout is ``pg_timeout`` seconds (default ``timeout``); with
    ``init_group=False`` ``fn`` creates the group itself.

    Raises :class:`RankFailedError` with the full traceback as soon as any rank raises
    (the other ranks are killed), or naming a rank that died without a result, and
    :class:`RankTimeoutError` naming the unfinished ranks after ``timeout`` seconds (each of
    them printed every thread's stack to its stderr a few seconds before).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    ctx = _start_context()
    caller = (dict(os.environ), _CallerStdio()) if ctx.get_start_method() == "forkserver" else None
    results = ctx.Queue()
    pg_timeout = timeout if pg_timeout is None else pg_timeout
    store = _host_store(world_size, pg_timeout)
    port = store.port
    deadline = time.monotonic() + timeout
    procs = [ctx.Process(target=_rank_main, name=f"tpinv-rank-{r}", daemon=True,
                         args=(fn, r, world_size, args, backend, port, pg_timeout, env, threads,
                               init_group, results, deadline, caller))
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        out = _collect(procs, results, deadline, timeout)
        grace = time.monotonic() + _EXIT_GRACE_SECONDS
        for p in procs:   # a rank killed mid-teardown would leave its own children behind
            p.join(timeout=max(grace - time.monotonic(), 0.0))
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5.0)
        results.close()
        del store


def _host_store(world_size: int, pg_timeout: float) -> dist.TCPStore:
    """The ranks' rendezvous store, served from this process on a port the kernel picks."""
    return dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=pg_timeout))


def _collect(procs, results, deadline: float, timeout: float) -> list[Any]:
    world_size = len(procs)
    done: dict[int, Any] = {}
    dead: dict[int, int | None] = {}      # rank -> exit code, for ranks gone without a message
    dead_seen_at: dict[int, float] = {}
    while len(done) + len(dead) < world_size:
        try:
            rank, ok, payload = results.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in done or r in dead or p.is_alive():
                    continue
                first = dead_seen_at.setdefault(r, now)
                if now - first > _DRAIN_SECONDS:
                    dead[r] = p.exitcode
            if now > deadline:
                missing = [r for r in range(world_size) if r not in done and r not in dead]
                raise RankTimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout:.1f} s"
                    + _dead_note(dead) + "; all ranks were killed (a rank still running "
                    f"{_STACK_DUMP_LEAD:.0f} s before the limit printed its stacks to stderr)")
            continue
        if not ok:
            raise RankFailedError(f"rank {rank} of {world_size} raised" + _dead_note(dead)
                                  + f":\n{payload}", done)
        done[rank] = pickle.loads(payload)
    if dead:
        raise RankFailedError(f"{len(done)} of {world_size} ranks returned" + _dead_note(dead),
                              done)
    return [done[r] for r in range(world_size)]


def _dead_note(dead: dict[int, int | None]) -> str:
    if not dead:
        return ""
    return "; " + ", ".join(f"rank {r} exited with code {c} without a result"
                            for r, c in sorted(dead.items()))


def caught(fn: Callable[[], Any]) -> tuple[str, str] | None:
    """``(exception type name, message)`` of what ``fn()`` raised, or None: a rank's error in a
    form it can return to the parent, so a test can check that every rank failed alike."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the caller inspects the type and message
        return type(exc).__name__, str(exc)
    return None
