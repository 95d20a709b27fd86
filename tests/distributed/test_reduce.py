"""The tree reducer gives the single-process tree's bits with every algorithm at 1, 2, 4 ranks;
plain ``all_reduce`` does not keep its bits across TP sizes (the negative controls); bad settings
raise clear errors on every rank and never hang."""
import os
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from tpinv.core.contract import rank_leaves, tree_combine, tree_combine_list
from tpinv.kernels.reference_tree import leaf_partials, leaf_tree_sum
import tpinv.distributed.collective_calls as calls_module
from tpinv.distributed.reduce import (ALGORITHMS, CHECK_ENV, CollectiveError, algorithms_for, all_gather,
                          choose_algorithm, tree_all_reduce, tree_reduce_scatter)
from tpinv.testing import RankFailedError, assert_bits_differ, assert_same_bits, caught, record_ops, run_ranks

WORLDS = (1, 2, 4)
SHAPES = [(7,), (4, 3), (5, 3, 17), (3, 12, 5), (), (0, 3), (8, 1001)]
GATHER_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
K, LEAVES, ROWS = 8 * 129, 8, 64


def _wide(shape):
    """Random fp32 over seven decades, so different add orders round differently."""
    return torch.randn(shape) * 10.0 ** torch.randint(-3, 4, shape)


# ---------------------------------------------------------------------------- spawned ranks
def _correctness_rank(rank, world, cases, gathers, x):
    out = {"reduce": {}, "scatter": {}, "gather": {}, "ops": {}}
    for i, parts in enumerate(cases):
        mine = parts[rank].clone()
        for algorithm, check in [(a, True) for a in algorithms_for(world) + ("auto",)] + [("auto", False)]:
            out["reduce"][i, algorithm, check] = tree_all_reduce(
                mine, dist.group.WORLD, algorithm=algorithm, check=check)
        assert_same_bits(mine, parts[rank], "the input partial was modified")
        for dim in range(mine.dim()):
            if mine.shape[dim] % world == 0:
                for algorithm in algorithms_for(world) + ("auto",):
                    out["scatter"][i, dim, algorithm] = tree_reduce_scatter(
                        mine, dist.group.WORLD, dim=dim, algorithm=algorithm)
    for i, tensors in enumerate(gathers):
        for dim in (0, -1):
            out["gather"][i, dim] = all_gather(tensors[rank], dist.group.WORLD, dim=dim)
    strided = cases[-1][rank].t()  # a non-contiguous partial
    out["strided"] = tree_all_reduce(strided, dist.group.WORLD, algorithm="halving")
    for algorithm in algorithms_for(world):
        with record_ops() as seen:
            tree_all_reduce(mine, dist.group.WORLD, algorithm=algorithm)
        out["ops"][algorithm] = set(seen.names)
    # TP invariance: leaf sub-trees through the tree reducer; vanilla slice sums + all_reduce.
    my_leaves = rank_leaves(rank, world, LEAVES)
    per = x.shape[-1] // LEAVES
    my_slice = x[:, my_leaves.start * per: my_leaves.stop * per]
    subtree = tree_combine(leaf_partials(my_slice, len(my_leaves)))
    out["tree_tp"] = tree_all_reduce(subtree, dist.group.WORLD)
    vanilla = my_slice.sum(-1)
    dist.all_reduce(vanilla)
    out["vanilla_tp"] = vanilla
    plain_subtree = subtree.clone()
    dist.all_reduce(plain_subtree)
    out["plain_all_reduce_of_subtrees"] = plain_subtree
    if world == 2:
        out["errors"] = _errors(rank)
        out["check_policy"] = _check_policy(rank)
    if world == 4:  # explicit sub-groups: consecutive pairs, strided pairs, and three ranks
        out["pair_sum_refused"] = caught(
            lambda: tree_all_reduce(torch.ones(4), dist.group.WORLD, algorithm="pair_sum"))
        three = dist.new_group([0, 1, 2])
        if rank < 3:
            out["three"] = caught(lambda: tree_all_reduce(torch.ones(4), three))
        for name, layout in (("pairs", [[0, 1], [2, 3]]), ("stride_pairs", [[0, 2], [1, 3]])):
            groups = [dist.new_group(ranks) for ranks in layout]
            mine_group = next(g for g, ranks in zip(groups, layout) if rank in ranks)
            out[name] = {a: tree_all_reduce(cases[-1][rank], mine_group, algorithm=a)
                         for a in ALGORITHMS}
    return out


@pytest.fixture(scope="module")
def spawned():
    cases = {w: [[_wide(s) for _ in range(w)] for s in SHAPES] for w in WORLDS}
    gathers = {w: [[_wide((3, 5)).to(d) if d != torch.bool else torch.rand(3, 5) > 0.5
                    for _ in range(w)] for d in GATHER_DTYPES] for w in WORLDS}
    x = _wide((ROWS, K))
    results = {w: run_ranks(_correctness_rank, w, cases[w], gathers[w], x, timeout=240)
               for w in WORLDS}
    return cases, gathers, x, results


@pytest.mark.parametrize("world", WORLDS)
def test_every_algorithm_equals_single_process_tree(spawned, world):
    cases, _, _, results = spawned
    for i, parts in enumerate(cases[world]):
        reference = tree_combine_list(parts) if world > 1 else parts[0]
        for rank in range(world):
            for (j, algorithm, check), got in results[world][rank]["reduce"].items():
                if j == i:
                    assert got.shape == reference.shape and got.is_contiguous()
                    assert_same_bits(got, reference, str((world, parts[0].shape, algorithm, check)))


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_is_a_chunk_of_the_tree(spawned, world):
    cases, _, _, results = spawned
    seen = 0
    for rank in range(world):
        for (i, dim, algorithm), got in results[world][rank]["scatter"].items():
            reference = tree_combine_list(cases[world][i]) if world > 1 else cases[world][i][0]
            chunk = reference.shape[dim] // world
            expected = reference.narrow(dim, rank * chunk, chunk)
            assert got.is_contiguous(), (world, i, dim, algorithm)
            assert_same_bits(got, expected, str((world, i, dim, algorithm)))
            seen += 1
    assert seen >= world * 4 * (len(algorithms_for(world)) + 1)


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_is_exact_for_every_dtype(spawned, world):
    _, gathers, _, results = spawned
    for rank in range(world):
        for (i, dim), got in results[world][rank]["gather"].items():
            expected = torch.cat(gathers[world][i], dim=dim)
            assert got.dtype == GATHER_DTYPES[i], (i, dim)
            assert_same_bits(got, expected, str((i, dim)))


@pytest.mark.parametrize("world", (2, 4))
def test_strided_input_and_invariant_path_ran(spawned, world):
    cases, _, _, results = spawned
    reference = tree_combine_list([p.t() for p in cases[world][-1]])
    for rank in range(world):
        r = results[world][rank]
        assert_same_bits(r["strided"], reference, "r['strided']")
        assert "c10d::alltoall_base_" in r["ops"]["all_to_all"]
        assert "c10d::send" in r["ops"]["halving"] and "c10d::recv_" in r["ops"]["halving"]
        assert all("c10d::allreduce_" not in ops for a, ops in r["ops"].items() if a != "pair_sum")
        if world == 2:
            assert "c10d::allreduce_" in r["ops"]["pair_sum"]


def test_sub_groups_reduce_in_group_rank_order(spawned):
    cases, _, _, results = spawned
    parts = cases[4][-1]
    for name, layout in (("pairs", [[0, 1], [2, 3]]), ("stride_pairs", [[0, 2], [1, 3]])):
        for ranks in layout:
            expected = tree_combine_list([parts[r] for r in ranks])
            for r in ranks:
                for algorithm, got in results[4][r][name].items():
                    assert_same_bits(got, expected, str((name, ranks, algorithm)))


def test_tree_is_tp_invariant_and_plain_all_reduce_is_not(spawned):
    *_, x, results = spawned
    single = leaf_tree_sum(x, LEAVES)
    for world in WORLDS:
        for rank in range(world):
            assert_same_bits(results[world][rank]["tree_tp"], single, str(world))
    # Negative controls on the same inputs: vanilla slice sums + all_reduce change with TP ...
    vanilla = {w: results[w][0]["vanilla_tp"] for w in WORLDS}
    assert_bits_differ(vanilla[1], vanilla[2], 'vanilla[1]')
    assert_bits_differ(vanilla[2], vanilla[4], 'vanilla[2]')
    assert_bits_differ(vanilla[1], single, 'vanilla[1]')
    # ... and even the tree's own sub-trees, summed by all_reduce at 4 ranks, lose the tree order;
    # at 2 ranks the tree is one add, which the plain all_reduce computes too ("pair_sum").
    assert_bits_differ(results[4][0]["plain_all_reduce_of_subtrees"], single,
                       "results[4][0]['plain_all_reduce_of_subtrees']")
    assert_same_bits(results[2][0]["plain_all_reduce_of_subtrees"], single,
                     "results[2][0]['plain_all_reduce_of_subtrees']")


def test_pair_sum_is_refused_beyond_two_ranks(spawned):
    for r in spawned[3][4]:
        kind, message = r["pair_sum_refused"]
        assert kind == "InvarianceError" and "exactly 2 ranks" in message


# ------------------------------------------------------------------------ single process
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), leaf_len=st.integers(1, 33), log_leaves=st.integers(0, 4),
       data=st.data())
def test_tree_over_leaves_equals_tree_over_rank_subtrees(rows, leaf_len, log_leaves, data):
    leaves = 1 << log_leaves
    size = 1 << data.draw(st.integers(0, log_leaves))
    x = _wide((rows, leaves * leaf_len))
    leaf = leaf_partials(x, leaves)
    subtrees = [tree_combine(leaf[:, rank_leaves(r, size, leaves)]) for r in range(size)]
    assert_same_bits(tree_combine_list(subtrees), tree_combine(leaf), 'tree_combine_list(subtrees)')
    assert_same_bits(tree_combine(torch.stack(subtrees, -1)), leaf_tree_sum(x, leaves),
                     'tree_combine(torch.stack(subtrees, -1))')


def test_auto_choice_depends_on_the_bytes_each_rank_receives():
    assert choose_algorithm(1024, 4) == "all_gather"
    assert choose_algorithm(64 << 20, 4) == "all_to_all"
    assert choose_algorithm(8 << 20, 2, "nccl") == "pair_sum"  # two ranks: the tree is one add
    assert choose_algorithm(8 << 20, 2, "gloo") == "all_to_all"
    assert choose_algorithm(8 << 20, 4, "nccl") == "all_to_all"  # receives 3 x 8 MiB
    assert {choose_algorithm(n, c, b) for n in (1 << 10, 1 << 20, 1 << 26) for c in (2, 4, 8)
            for b in ("gloo", "nccl")} == {"all_gather", "all_to_all", "pair_sum"}


# ---------------------------------------------------------------------------------- errors
def _errors(rank):
    """Every call here must fail the same way on both ranks and leave the group usable."""
    shape = (5, 3) if rank == 0 else (5, 4)
    dtype = torch.float32 if rank == 0 else torch.float16
    bf16 = torch.ones(5, dtype=torch.bfloat16)
    return {
        "bf16": caught(lambda: tree_all_reduce(bf16, dist.group.WORLD)),
        "bf16_unchecked": caught(lambda: tree_all_reduce(bf16, dist.group.WORLD, check=False)),
        "shapes": caught(lambda: tree_all_reduce(torch.ones(shape), dist.group.WORLD)),
        "dtypes": caught(lambda: tree_all_reduce(torch.ones(5, dtype=dtype), dist.group.WORLD)),
        "gather_shapes": caught(lambda: all_gather(torch.ones(shape), dist.group.WORLD)),
        "scatter_indivisible": caught(lambda: tree_reduce_scatter(torch.ones(5, 3), dist.group.WORLD)),
        "algorithm": caught(lambda: tree_all_reduce(torch.ones(5), dist.group.WORLD, algorithm="ring")),
        "leaves": caught(lambda: tree_all_reduce(torch.ones(5), dist.group.WORLD, leaves=1)),
        "none_group": caught(lambda: tree_all_reduce(torch.ones(5), None)),
        "none_gather": caught(lambda: all_gather(torch.ones(5), None)),
        "still_works": tree_all_reduce(torch.full((3,), float(rank + 1)), dist.group.WORLD),
    }


def _check_policy(rank):
    """How many descriptor checks each call makes (the descriptor is the only int64 exchange)."""
    checks = []
    real = calls_module.all_gather_single

    def counting(out, inp, group):
        checks.append(inp.dtype == torch.int64)
        real(out, inp, group)

    def count(fn):
        del checks[:]
        result = fn()
        return sum(checks), result

    a, b, world = torch.full((6, 4), rank + 1.0), torch.full((6, 8), rank + 1.0), dist.group.WORLD
    calls_module.all_gather_single = counting
    try:
        out = {
            "first": count(lambda: tree_all_reduce(a, world))[0],
            "again": count(lambda: tree_all_reduce(a, world))[0],
            "other_op": count(lambda: all_gather(a, world))[0],
            "other_op_again": count(lambda: all_gather(a, world))[0],
            "scatter": count(lambda: tree_reduce_scatter(a, world))[0],
            "scatter_again": count(lambda: tree_reduce_scatter(a, world))[0],
            "other_shape": count(lambda: tree_all_reduce(b, world))[0],
            "always": count(lambda: tree_all_reduce(a, world, check="always"))[0],
            "unchecked": count(lambda: tree_all_reduce(a, world, check=False))[0],
            "bad_value": caught(lambda: tree_all_reduce(a, world, check="sometimes")),
        }
        os.environ[CHECK_ENV] = "always"
        try:
            out["env_always"], out["env_result"] = count(lambda: tree_all_reduce(a, world))
        finally:
            del os.environ[CHECK_ENV]
        # Both signatures were verified above; a rank that diverges onto the other one is caught
        # only by a check of every call.
        out["diverged_always"] = caught(
            lambda: tree_all_reduce(a if rank == 0 else b, world, check="always"))
        out["still_works"] = tree_all_reduce(a, world)
    finally:
        calls_module.all_gather_single = real
    return out


def test_each_signature_is_checked_once_unless_always(spawned):
    results = spawned[-1][2]
    for rank in range(2):
        r = results[rank]["check_policy"]
        assert (r["first"], r["again"]) == (1, 0), r
        assert (r["other_op"], r["other_op_again"]) == (1, 0), r       # per op, not per shape alone
        assert (r["scatter"], r["scatter_again"]) == (1, 0), r
        assert r["other_shape"] == 1 and r["always"] == 1 and r["env_always"] == 1, r
        assert r["unchecked"] == 0, r
        assert r["bad_value"][0] == "ValueError" and "sometimes" in r["bad_value"][1]
        kind, message = r["diverged_always"]
        assert kind == "InvarianceError" and "(6, 4)" in message and "(6, 8)" in message, r
        assert_same_bits(r["env_result"], torch.full((6, 4), 3.0), str(rank))
        assert_same_bits(r["still_works"], torch.full((6, 4), 3.0), str(rank))


def test_a_bad_check_value_is_refused_in_a_group_of_one_too():
    from tpinv.distributed.groups import LOCAL
    for fn in (tree_all_reduce, tree_reduce_scatter, all_gather):
        with pytest.raises(ValueError, match="check='sometimes'"):
            fn(torch.ones(4), LOCAL, check="sometimes")


def test_errors_are_clear_and_raised_on_every_rank(spawned):
    results = spawned[-1][2]
    for rank in range(2):
        r = results[rank]["errors"]
        assert r["bf16"][0] == "TypeError" and "fp32" in r["bf16"][1]
        assert r["bf16_unchecked"][0] == "TypeError"
        assert r["shapes"][0] == "InvarianceError"
        assert "(5, 3)" in r["shapes"][1] and "(5, 4)" in r["shapes"][1]
        assert r["dtypes"][0] == "InvarianceError" and "torch.float16" in r["dtypes"][1]
        assert r["gather_shapes"][0] == "InvarianceError"
        assert r["scatter_indivisible"][0] == "InvarianceError"
        assert "multiple of 2" in r["scatter_indivisible"][1]
        assert r["algorithm"][0] == "ValueError" and "ring" in r["algorithm"][1]
        assert r["leaves"][0] == "InvarianceError"
        for key in ("none_group", "none_gather"):  # None is a single rank; among two it raises
            assert r[key][0] == "InvarianceError" and "group=None" in r[key][1], r[key]
        assert_same_bits(r["still_works"], torch.full((3,), 3.0), str(rank))


def test_group_of_three_is_refused_on_every_rank(spawned):
    results = spawned[-1][4]
    for rank in range(3):
        kind, message = results[rank]["three"]
        assert kind == "InvarianceError" and "power of two" in message


def _rank_dies_rank(rank, world, hang):
    if rank == 1:
        if hang:
            time.sleep(30)
        os._exit(3)
    return tree_all_reduce(torch.ones(1000), dist.group.WORLD, algorithm="all_to_all")


@pytest.mark.parametrize("hang", [False, True], ids=["exits", "hangs"])
def test_a_dead_or_stuck_rank_makes_the_others_raise(hang):
    with pytest.raises(RankFailedError) as info:
        run_ranks(_rank_dies_rank, 2, hang, pg_timeout=3.0, timeout=60)
    text = str(info.value)
    assert CollectiveError.__name__ in text and "tree_all_reduce" in text
    assert "over a group of 2 ranks failed" in text and "process-group timeout" in text
