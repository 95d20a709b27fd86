"""Each autograd region's forward and backward at 1, 2 and 4 ranks equal the single-process
equivalent bitwise (the tree over the ranks' fp32 partials; exact gathers and slices)."""
import pytest
import torch
import torch.distributed as dist

from tpinv.core.contract import tree_combine_list
from tpinv.distributed.mappings import (copy_to_tensor_model_parallel_region,
                            gather_from_sequence_parallel_region,
                            gather_from_tensor_model_parallel_region,
                            reduce_from_tensor_model_parallel_region,
                            reduce_scatter_to_sequence_parallel_region,
                            scatter_to_sequence_parallel_region,
                            scatter_to_tensor_model_parallel_region)
from tpinv.testing import assert_bits_differ, assert_same_bits, record_ops, run_ranks

WORLDS = (1, 2, 4)
S, H = 8, 12  # dims split by sequence / tensor parallelism (divisible by 1, 2, 4)


def _wide(*shape):
    return torch.randn(shape) * 10.0 ** torch.randint(-3, 4, shape)


def _chunk(t, rank, world, dim):
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n)


def _run(region, x, grad, **kwargs):
    x = x.clone().requires_grad_(True)
    y = region(x, dist.group.WORLD, **kwargs)
    y.backward(grad)
    return y.detach(), x.grad


def _regions_rank(rank, world, data):
    me = {k: v[rank] if isinstance(v, list) else v for k, v in data.items()}
    out = {}
    with record_ops() as seen:
        out["copy_to"] = _run(copy_to_tensor_model_parallel_region, me["full"], me["g_full"])
        out["reduce_from"] = _run(reduce_from_tensor_model_parallel_region, me["p_full"],
                                  data["g_full"][0])
    out["ops"] = set(seen.names)
    out["scatter_tp"] = _run(scatter_to_tensor_model_parallel_region, data["full"],
                             _chunk(me["g_full"], rank, world, -1))
    out["gather_tp"] = _run(gather_from_tensor_model_parallel_region,
                            _chunk(data["full"], rank, world, -1), data["g_full"][0])
    out["scatter_sp"] = _run(scatter_to_sequence_parallel_region, data["full"],
                             _chunk(me["g_full"], rank, world, 0))
    out["gather_sp"] = _run(gather_from_sequence_parallel_region,
                            _chunk(data["full"], rank, world, 0), me["g_full"])
    out["gather_sp_no_reduce"] = _run(gather_from_sequence_parallel_region,
                                      _chunk(data["full"], rank, world, 0), me["g_full"],
                                      tensor_parallel_output_grad=False)
    out["reduce_scatter_sp"] = _run(reduce_scatter_to_sequence_parallel_region, me["p_full"],
                                    _chunk(me["g_full"], rank, world, 0))
    plain = me["p_full"].clone()
    dist.all_reduce(plain)
    out["plain_all_reduce"] = plain
    errors = {}
    bf16 = data["full"].to(torch.bfloat16)
    for name, region in (("copy_to", copy_to_tensor_model_parallel_region),
                         ("reduce_from", reduce_from_tensor_model_parallel_region),
                         ("gather_sp", gather_from_sequence_parallel_region),
                         ("reduce_scatter_sp", reduce_scatter_to_sequence_parallel_region)):
        try:
            region(bf16, dist.group.WORLD)
        except TypeError as exc:
            errors[name] = str(exc)
    try:
        scatter_to_tensor_model_parallel_region(torch.ones(3, 5), dist.group.WORLD)
    except ValueError as exc:
        errors["indivisible"] = str(exc)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def spawned():
    data = {w: {"full": _wide(S, H), "p_full": [_wide(S, H) for _ in range(w)],
                "g_full": [_wide(S, H) for _ in range(w)]} for w in WORLDS}
    return data, {w: run_ranks(_regions_rank, w, data[w], timeout=240) for w in WORLDS}


def _eq(got, expected, what):
    assert got.shape == expected.shape, what
    assert_same_bits(got, expected, str(what))


@pytest.mark.parametrize("world", WORLDS)
def test_tensor_parallel_regions(spawned, world):
    data, results = spawned
    d = data[world]
    g_tree = tree_combine_list(d["g_full"]) if world > 1 else d["g_full"][0]
    p_tree = tree_combine_list(d["p_full"]) if world > 1 else d["p_full"][0]
    for rank, r in enumerate(results[world]):
        y, gx = r["copy_to"]
        _eq(y, d["full"], "copy_to forward is the identity")
        _eq(gx, g_tree, "copy_to backward is the tree over the ranks' gradients")
        y, gx = r["reduce_from"]
        _eq(y, p_tree, "reduce_from forward is the tree over the ranks' partials")
        _eq(gx, d["g_full"][0], "reduce_from backward is the identity")
        y, gx = r["scatter_tp"]
        _eq(y, _chunk(d["full"], rank, world, -1), "scatter_to forward keeps the rank's slice")
        _eq(gx, torch.cat([_chunk(g, i, world, -1) for i, g in enumerate(d["g_full"])], -1),
            "scatter_to backward gathers the last dim")
        y, gx = r["gather_tp"]
        _eq(y, d["full"], "gather_from forward gathers the last dim")
        _eq(gx, _chunk(d["g_full"][0], rank, world, -1), "gather_from backward slices")
        if world > 1:
            assert "c10d::allreduce_" not in r["ops"] and "c10d::_allgather_base_" in r["ops"]


@pytest.mark.parametrize("world", WORLDS)
def test_sequence_parallel_regions(spawned, world):
    data, results = spawned
    d = data[world]
    g_tree = tree_combine_list(d["g_full"]) if world > 1 else d["g_full"][0]
    p_tree = tree_combine_list(d["p_full"]) if world > 1 else d["p_full"][0]
    for rank, r in enumerate(results[world]):
        y, gx = r["scatter_sp"]
        _eq(y, _chunk(d["full"], rank, world, 0), "scatter_to_sp forward keeps the rank's rows")
        _eq(gx, torch.cat([_chunk(g, i, world, 0) for i, g in enumerate(d["g_full"])], 0),
            "scatter_to_sp backward gathers dim 0")
        y, gx = r["gather_sp"]
        _eq(y, d["full"], "gather_from_sp forward gathers dim 0")
        _eq(gx, _chunk(g_tree, rank, world, 0), "gather_from_sp backward tree reduce-scatters")
        y, gx = r["gather_sp_no_reduce"]
        _eq(gx, _chunk(d["g_full"][rank], rank, world, 0), "no-reduce backward slices")
        y, gx = r["reduce_scatter_sp"]
        _eq(y, _chunk(p_tree, rank, world, 0), "reduce_scatter_sp forward is a chunk of the tree")
        _eq(gx, torch.cat([_chunk(g, i, world, 0) for i, g in enumerate(d["g_full"])], 0),
            "reduce_scatter_sp backward gathers dim 0")


def test_plain_all_reduce_differs_from_the_tree_at_four_ranks(spawned):
    """Negative control for reduce_from: Megatron's plain all_reduce on the same partials."""
    data, results = spawned
    tree = results[4][0]["reduce_from"][0]
    assert_same_bits(tree, tree_combine_list(data[4]["p_full"]), 'tree')
    assert_bits_differ(results[4][0]["plain_all_reduce"], tree, "results[4][0]['plain_all_reduce']")


@pytest.mark.parametrize("world", WORLDS)
def test_reducing_regions_refuse_non_fp32(spawned, world):
    _, results = spawned
    for r in results[world]:
        errors = r["errors"]
        reducing = {"copy_to", "reduce_from", "gather_sp", "reduce_scatter_sp"}
        assert set(errors) == (reducing | {"indivisible"} if world > 1 else reducing)
        for name in ("copy_to", "reduce_from", "gather_sp", "reduce_scatter_sp"):
            assert "fp32" in errors[name] and "torch.bfloat16" in errors[name], name
        if world > 1:
            assert f"multiple of {world}" in errors["indivisible"]
