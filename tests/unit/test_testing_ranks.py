"""tpinv.testing.run_ranks: the rendezvous port belongs to the caller for the ranks' whole life."""
from __future__ import annotations

import errno
import os
import socket

import pytest
import torch
import torch.distributed as dist

from tpinv.testing import run_ranks


def _try_bind_master_port(rank, world_size):
    """Bind MASTER_PORT before any group exists: errno if taken, 0 if this rank got it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        except OSError as err:
            return err.errno
    return 0


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_the_port_is_held_before_any_rank_binds_it():
    # A port picked, released and bound later by rank 0 could be taken by another run in between
    # (two pytest-xdist workers once met on one): the caller's store holds it throughout.
    assert run_ranks(_try_bind_master_port, 2, init_group=False) == [errno.EADDRINUSE] * 2


def test_control_a_released_port_can_be_taken():
    # Control: the same probe on a port nobody holds succeeds, so the check above can fail.
    from tpinv.testing import free_port
    assert run_ranks(_try_bind_master_port, 1, init_group=False,
                     env={"MASTER_PORT": str(free_port())}) == [0]


@pytest.mark.parametrize("world_size", [1, 3])
def test_ranks_meet_through_the_callers_store(world_size):
    assert run_ranks(_all_reduce_rank, world_size) == [world_size * (world_size + 1) / 2] * world_size


def _reduce_then_block_teardown(rank, world_size):
    """All-reduce; rank 1's group teardown then blocks for two minutes holding the GIL (as gloo's
    ``destroy_process_group`` was seen to on torch 2.6), so its queue's feeder thread, which
    writes a result into the pipe, cannot run once the teardown begins."""
    import ctypes
    result = _all_reduce_rank(rank, world_size)
    if rank == 1:
        sleep_holding_the_gil = ctypes.PyDLL(None).sleep   # looked up now: nothing left to load
        dist.destroy_process_group = lambda: sleep_holding_the_gil(120)
    return result


def test_a_result_arrives_though_the_teardown_blocks_holding_the_gil():
    # The result is in the pipe before the group is torn down, so a rank stuck in teardown still
    # reports (and is then killed).  Were the result left to the feeder thread, rank 1 would
    # time out here (checked by hand with the wait removed: RankTimeoutError naming rank 1).
    assert run_ranks(_reduce_then_block_teardown, 3, timeout=60.0) == [6.0] * 3


def test_a_free_port_for_a_launcher_lies_below_the_kernels_ephemeral_range():
    # A launcher binds the port seconds after it is picked; the kernel hands ports of its
    # ephemeral range to other sockets meanwhile (gloo's, in a parallel worker), never one below.
    from tpinv.testing import free_port
    from tpinv.testing.ranks import _LOWEST_PORT, _ephemeral_low
    if _ephemeral_low() <= _LOWEST_PORT + 1:
        pytest.skip(f"this kernel's ephemeral range starts at {_ephemeral_low()}: no port lies below it")
    ports = [free_port() for _ in range(20)]
    assert all(_LOWEST_PORT <= p < _ephemeral_low() for p in ports), ports
    assert len(set(ports)) > 1, ports   # drawn, not one fixed port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))
    # control: a port the kernel picks itself lies inside the range, so the bound above can fail
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= _ephemeral_low()
