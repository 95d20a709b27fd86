"""ParallelDims builds TP-innermost groups from the torchrun environment at world 4 for TP 1, 2,
4, taken from one ("dp", "tp") DeviceMesh that the DTensor path accepts; settings that would break
the leaf tree or the layout are refused with clear errors; megatron's initialized groups are
adopted as they are, with the mesh over them."""
import importlib.util
import os
import time

import pytest
import torch
import torch.distributed as dist

from tpinv.core.contract import InvarianceError
from tpinv.distributed.parallel import ParallelDims, ParallelState
from tpinv.distributed.reduce import tree_all_reduce
from tpinv.testing import RankTimeoutError, assert_same_bits, bits, record_ops, run_ranks

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None \
    and importlib.util.find_spec("megatron.core") is not None


def _layout(state):
    from tpinv.dtensor.styles import mesh_info
    info = mesh_info(state.tp_mesh, state.leaves)  # the DTensor path takes the same mesh
    return {"tp": (state.tp_rank, state.tp_size, dist.get_process_group_ranks(state.tp_group)),
            "dp": (state.dp_rank, state.dp_size, dist.get_process_group_ranks(state.dp_group)),
            "world": (state.rank, state.world_size),
            "mesh": (state.mesh.mesh_dim_names, state.mesh.mesh.tolist(), state.tp_mesh.mesh.tolist(),
                     state.dp_mesh.mesh.tolist(), state.tp_mesh.get_group() is state.tp_group,
                     state.dp_mesh.get_group() is state.dp_group, (info.rank, info.size))}


def _build_rank(rank, world, with_megatron):
    out = {"initialized_before": dist.is_initialized()}
    out[2] = _layout(ParallelDims(2).build(backend="gloo", timeout=60))  # initializes the world
    out[1] = _layout(ParallelDims(1).build())
    state = ParallelDims(4, dp=1).build()
    out[4] = _layout(state)
    out["tree"] = tree_all_reduce(torch.full((3,), float(rank)), state.tp_group)
    try:
        ParallelState.from_mesh(state.tp_mesh)
    except ValueError as exc:
        out["from_1d_mesh"] = str(exc)
    try:
        ParallelDims(8).build()
    except InvarianceError as exc:
        out["tp8"] = str(exc)
    if with_megatron:
        from megatron.core import parallel_state as mpu
        try:
            ParallelState.from_megatron()
        except RuntimeError as exc:
            out["megatron_uninitialized"] = str(exc)
        mpu.initialize_model_parallel(tensor_model_parallel_size=2)
        out["megatron"] = _layout(ParallelState.from_megatron())
        mpu.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def built():
    return run_ranks(_build_rank, 4, HAVE_MEGATRON, init_group=False, timeout=240)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_groups_are_tp_innermost(built, tp):
    dp = 4 // tp
    for rank, out in enumerate(built):
        assert not out["initialized_before"]
        tp_rank, tp_size, tp_ranks = out[tp]["tp"]
        dp_rank, dp_size, dp_ranks = out[tp]["dp"]
        assert (tp_rank, tp_size, dp_rank, dp_size) == (rank % tp, tp, rank // tp, dp)
        first = rank - rank % tp
        assert tp_ranks == list(range(first, first + tp))
        assert dp_ranks == list(range(rank % tp, 4, tp))
        assert out[tp]["world"] == (rank, 4)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_groups_come_from_one_dp_by_tp_mesh(built, tp):
    dp = 4 // tp
    for rank, out in enumerate(built):
        names, mesh, tp_mesh, dp_mesh, same_tp, same_dp, dtensor = out[tp]["mesh"]
        assert names == ("dp", "tp") and mesh == [[d * tp + t for t in range(tp)] for d in range(dp)]
        assert tp_mesh == out[tp]["tp"][2] and dp_mesh == out[tp]["dp"][2]
        assert same_tp and same_dp  # the layer path's groups are the mesh's
        assert dtensor == (rank % tp, tp)


def test_built_tp_group_reduces(built):
    for out in built:
        assert_same_bits(out["tree"], torch.full((3,), float((0 + 1) + (2 + 3))), "out['tree']")


def test_from_mesh_needs_the_dp_by_tp_mesh(built):
    for out in built:
        assert "expected a 2-D DeviceMesh with mesh_dim_names ('dp', 'tp')" in out["from_1d_mesh"]


def test_tp_not_dividing_the_world_is_refused_on_every_rank(built):
    for out in built:
        assert "tp=8 does not divide the world size 4" in out["tp8"]


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not installed")
def test_from_megatron_adopts_megatrons_groups(built):
    for out in built:
        assert "initialize_model_parallel" in out["megatron_uninitialized"]
        assert out["megatron"] == out[2]


@pytest.mark.parametrize("tp", [3, 6, 0, -2])
def test_tp_must_be_a_positive_power_of_two(tp):
    with pytest.raises((InvarianceError, ValueError), match="tp="):
        ParallelDims(tp)


def test_tp_must_divide_the_leaves():
    with pytest.raises(InvarianceError, match="does not divide leaves=8"):
        ParallelDims(16)
    assert ParallelDims(16, leaves=16).resolve(32) == (16, 2)


def test_resolve_checks_the_world_size():
    assert ParallelDims(2).resolve(6) == (2, 3)
    with pytest.raises(InvarianceError, match=r"tp=4 does not divide the world size 6.*\[1, 2\]"):
        ParallelDims(4).resolve(6)
    with pytest.raises(InvarianceError, match="set dp=2"):
        ParallelDims(2, dp=3).resolve(4)
    with pytest.raises(ValueError, match="dp=0"):
        ParallelDims(2, dp=0)


def test_build_without_torchrun_says_how_to_start(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        ParallelDims(1).build(backend="gloo")


# ------------------------------------------------------------- the multi-rank test harness
def _sleep_rank(rank, world):
    if rank == 1:
        time.sleep(300)
    return rank


def test_run_ranks_names_the_ranks_that_did_not_finish(capfd):
    # Generous enough for rank 0 to start and finish on a loaded 2-core machine.
    with pytest.raises(RankTimeoutError, match=r"ranks \[1\] of 2 did not finish within 20.0 s"):
        run_ranks(_sleep_rank, 2, timeout=20.0)
    # The unfinished rank printed where it was before it was killed.
    err = capfd.readouterr().err
    assert "Timeout (" in err and "in _sleep_rank" in err


def _start_rank(rank, world):
    print(f"rank {rank} writes to the caller's stdout")
    return {"parent": os.getppid(), "mark": os.environ.get("TPINV_TEST_RANKS_MARK"),
            "test": os.environ.get("PYTEST_CURRENT_TEST")}


@pytest.mark.skipif("forkserver" not in __import__("multiprocessing").get_all_start_methods(),
                    reason="no fork server on this platform: ranks are spawned")
def test_ranks_start_from_the_fork_server_with_the_callers_environment_and_stdout(monkeypatch, capfd):
    plain = run_ranks(_start_rank, 2)
    # forked by the fork server (its child, not ours), with this test's environment and stdout
    assert all(r["parent"] != os.getpid() and r["mark"] is None for r in plain)
    assert all(r["test"] == os.environ["PYTEST_CURRENT_TEST"] for r in plain)
    assert "rank 1 writes to the caller's stdout" in capfd.readouterr().out
    # another environment than the fork server's: spawned (our children), seeing it
    monkeypatch.setenv("TPINV_TEST_RANKS_MARK", "set after the fork server started")
    changed = run_ranks(_start_rank, 2)
    assert all(r["parent"] == os.getpid() and r["mark"] == "set after the fork server started" for r in changed)
    # control: TPINV_RANKS_START=spawn always spawns
    monkeypatch.delenv("TPINV_TEST_RANKS_MARK")
    monkeypatch.setenv("TPINV_RANKS_START", "spawn")
    spawned = run_ranks(_start_rank, 2)
    assert all(r["parent"] == os.getpid() for r in spawned)
    assert "rank 0 writes to the caller's stdout" in capfd.readouterr().out


_MANAGERS = []   # a rank's manager lives until the rank exits


def _manager_rank(rank, world):
    import multiprocessing
    from multiprocessing import util
    multiprocessing.current_process()._config["daemon"] = False   # as megatron's checkpoint test does
    manager = multiprocessing.get_context("spawn").Manager()        # shut down by a finalizer at exit
    util.Finalize(None, time.sleep, args=(2.0,), exitpriority=10)   # a teardown that takes a while
    _MANAGERS.append(manager)
    return manager._process.pid


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ranks_tear_down_their_children_before_run_ranks_returns(monkeypatch):
    pids = run_ranks(_manager_rank, 2)
    time.sleep(0.5)
    assert not any(_alive(p) for p in pids)
    # control: ranks killed as soon as their results are in leave their manager processes behind
    import tpinv.testing.ranks as ranks
    monkeypatch.setattr(ranks, "_EXIT_GRACE_SECONDS", 0.0)
    pids = run_ranks(_manager_rank, 2)
    time.sleep(0.5)
    orphans = [p for p in pids if _alive(p)]
    for p in orphans:
        os.kill(p, 9)
    assert orphans == pids


def test_record_ops_nests_and_bits_digest_exact_bytes():
    a = torch.randn(5)
    with record_ops() as outer:
        with record_ops() as inner:
            b = a + 1
        c = a * 2
    assert "aten::add" in inner and "aten::add.Tensor" in inner and "aten::mul" not in inner
    assert "aten::add" in outer and "aten::mul" in outer
    assert bits(b) == bits(b.clone()) and len(bits(b)) == 16
    assert bits(c) != bits(c.to(torch.float64).to(torch.float32).view(1, 5))  # shape counts
    assert bits(torch.tensor(0.0)) != bits(torch.tensor(-0.0))  # bytes, not values
    assert bits(torch.ones(2, dtype=torch.bfloat16)) != bits(torch.ones(2, dtype=torch.float16))
