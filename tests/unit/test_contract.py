"""The contract's validation, leaf bookkeeping and tree; the CPU leaf chain's row invariance.

Invariance is asserted bitwise; each invariance test has a negative control showing that the
plain torch path (``torch.sum``, split-then-add) changes its bits on the same inputs."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tpinv.core.contract import (DEFAULT_LEAVES, InvarianceError, check_divisible, check_dtype,
                            check_leaves, check_tp_size, leaf_bounds, rank_leaves, tree_combine,
                            tree_combine_list)
from tpinv.kernels.reference_tree import halving_sum, leaf_partials, leaf_tree_sum
from tpinv.testing import assert_bits_differ, assert_same_bits


def _wide(*shape):
    """Random fp32 over seven decades, so different add orders round differently."""
    return torch.randn(shape) * 10.0 ** torch.randint(-3, 4, shape)


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("leaves", [0, -2, 3, 6, 12, 2.0, "8"])
def test_check_leaves_refuses_non_powers_of_two(leaves):
    with pytest.raises(InvarianceError, match="power of two"):
        check_leaves(leaves)


@pytest.mark.parametrize("leaves", [1, 2, 8, 64])
def test_check_leaves_accepts_powers_of_two(leaves):
    assert check_leaves(leaves) == leaves


def test_check_tp_size_messages_say_what_to_change():
    with pytest.raises(InvarianceError, match="not a power of two"):
        check_tp_size(3)
    with pytest.raises(InvarianceError, match="does not divide leaves=8"):
        check_tp_size(16)
    with pytest.raises(InvarianceError, match="power of two"):
        check_tp_size(2, leaves=6)
    assert [check_tp_size(c) for c in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert check_tp_size(16, leaves=16) == 16


def test_check_divisible_suggests_a_multiple():
    assert check_divisible("K", 24, 8) == 3
    with pytest.raises(InvarianceError, match=r"K=10 is not divisible by leaves=8.*16"):
        check_divisible("K", 10, 8)


def test_check_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert check_dtype(dtype) is dtype
    with pytest.raises(InvarianceError, match="torch.int64 is not supported"):
        check_dtype(torch.int64, "weight")


# -------------------------------------------------------------------- leaf bookkeeping
def test_leaf_bounds_cut_equal_contiguous_leaves():
    assert leaf_bounds(24) == [(3 * i, 3 * i + 3) for i in range(8)]
    assert leaf_bounds(5, leaves=1) == [(0, 5)]
    with pytest.raises(InvarianceError, match="not divisible"):
        leaf_bounds(10)
    with pytest.raises(InvarianceError, match="power of two"):
        leaf_bounds(12, leaves=3)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_rank_leaves_partition_the_leaves_in_rank_order(size):
    owned = [list(rank_leaves(r, size)) for r in range(size)]
    assert sum(owned, []) == list(range(DEFAULT_LEAVES))
    assert all(len(o) == DEFAULT_LEAVES // size for o in owned)


def test_rank_leaves_refuses_bad_ranks_and_sizes():
    with pytest.raises(InvarianceError, match="outside a group of size 4"):
        rank_leaves(4, 4)
    with pytest.raises(InvarianceError, match="outside"):
        rank_leaves(-1, 2)
    with pytest.raises(InvarianceError, match="not a power of two"):
        rank_leaves(0, 3)


# -------------------------------------------------------------------------------- the tree
def test_tree_combine_is_the_adjacent_pair_tree():
    parts = _wide(33, 8)
    l = parts.unbind(-1)
    expected = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
    assert_same_bits(tree_combine(parts), expected, 'tree_combine(parts)')
    assert_same_bits(tree_combine_list(list(l)), expected, 'tree_combine_list(list(l))')
    assert_same_bits(tree_combine(parts.t().contiguous(), dim=0), expected,
                     'tree_combine(parts.t().contiguous(), dim=0)')
    # Negative control: the left-to-right chain over the same partials rounds differently.
    chain = l[0]
    for x in l[1:]:
        chain = chain + x
    assert_bits_differ(chain, expected, 'chain')


def test_tree_combine_refuses_bad_counts_and_dtypes():
    with pytest.raises(InvarianceError, match="power-of-two count of partials, got 3"):
        tree_combine(torch.ones(4, 3))
    with pytest.raises(InvarianceError, match="power-of-two count of partials, got 6"):
        tree_combine_list([torch.ones(2)] * 6)
    with pytest.raises(InvarianceError, match="fp32"):
        tree_combine(torch.ones(4, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("leaves", [1, 2, 4, 8, 16])
def test_tree_over_leaves_equals_k_split_recombination(leaves):
    """Rank sub-trees over a K split, recombined by the tree: the same bits at every size."""
    x = _wide(37, leaves * 131)
    whole = leaf_tree_sum(x, leaves)
    vanilla = {}
    for size in (c for c in (1, 2, 4, 8, 16) if c <= leaves):
        k = x.shape[-1] // size
        subtrees = [leaf_tree_sum(x[:, r * k:(r + 1) * k], leaves // size) for r in range(size)]
        assert_same_bits(tree_combine(torch.stack(subtrees, -1)), whole, str(size))
        # Negative control: torch.sum per K slice, then a left-to-right sum of the slices.
        acc = x[:, :k].sum(-1)
        for r in range(1, size):
            acc = acc + x[:, r * k:(r + 1) * k].sum(-1)
        vanilla[size] = acc
    if len(vanilla) > 1:
        assert len({tuple(v.tolist()) for v in vanilla.values()}) > 1, \
            "split-then-add gave the same bits at every split: the control cannot fail"


# ------------------------------------------------------------------------- the leaf chain
def test_halving_sum_order_and_zero_padding():
    x = _wide(9, 5)
    c = x.unbind(-1)  # padded to 8: [x0+x4, x1, x2, x3] -> [(x0+x4)+x2, x1+x3] -> sum
    assert_same_bits(halving_sum(x), ((c[0] + c[4]) + c[2]) + (c[1] + c[3]), 'halving_sum(x)')
    padded = torch.nn.functional.pad(x, (0, 11))
    assert_same_bits(halving_sum(padded), halving_sum(x), 'halving_sum(padded)')
    assert_same_bits(halving_sum(x[:, :1]), x[:, 0], 'halving_sum(x[:, :1])')


def test_one_leaf_reduction_is_the_leaf_chain_alone():
    """``leaf_tree_sum(x, 1)`` takes its one-leaf path (the halving sum of ``x`` itself): raw
    bytes equal to the general composition ``tree_combine(leaf_partials(x, 1))``, on rows, on a
    strided token-major view (the norm backward's partials) and on a zero-length row.  Control:
    ``2^24, 1, 1, -2^24`` gives 1 by the halving and 0 left to right, and the two differ."""
    x = _wide(9, 1000)
    partials = _wide(37, 6 * 16).view(37, 6, 16).permute(1, 2, 0)   # [heads, H, P], strided
    for t in (x, x[:, :1], x.t(), partials, torch.empty(3, 0)):
        assert_same_bits(leaf_tree_sum(t, 1), tree_combine(leaf_partials(t, 1)), f"{tuple(t.shape)}")
    row = torch.tensor([[2.0 ** 24, 1.0, 1.0, -2.0 ** 24]])
    assert_same_bits(leaf_tree_sum(row, 1), torch.tensor([1.0]), "the halving's pairs")
    assert_bits_differ(leaf_tree_sum(row, 1), ((row[:, 0] + row[:, 1]) + row[:, 2]) + row[:, 3],
                       "control: left to right")
    with pytest.raises(TypeError, match="fp32"):
        leaf_tree_sum(torch.ones(2, 8, dtype=torch.bfloat16), 1)


def test_leaf_partials_validation():
    with pytest.raises(TypeError, match="fp32"):
        leaf_partials(torch.ones(2, 8, dtype=torch.bfloat16), 8)
    with pytest.raises(InvarianceError, match="not divisible by leaves=8"):
        leaf_partials(torch.ones(2, 12), 8)
    assert leaf_partials(torch.ones(3, 16), 8).shape == (3, 8)


def test_leaf_tree_sum_rows_do_not_depend_on_the_batch():
    x = _wide(61, 8 * 257)
    whole = leaf_tree_sum(x, 8)
    alone = torch.stack([leaf_tree_sum(x[i:i + 1], 8)[0] for i in range(x.shape[0])])
    chunks = torch.cat([leaf_tree_sum(c, 8) for c in x.split(7)])
    strided = leaf_tree_sum(torch.stack([x, -x], 1)[:, 0], 8)  # row stride 2K
    column_major = leaf_tree_sum(x.t().contiguous().t(), 8)
    for got in (alone, chunks, strided, column_major):
        assert_same_bits(got, whole, 'got')
    # Negative control: torch.sum over the whole K vs torch.sum per K half, then added.
    half = x.shape[-1] // 2
    assert_bits_differ(x.sum(-1), x[:, :half].sum(-1) + x[:, half:].sum(-1), 'x.sum(-1)')


def test_add_is_position_independent():
    """The only arithmetic primitive of the tree: an fp32 add gives a value's bits anywhere."""
    a, b = _wide(1003), _wide(1003)
    full = a + b
    assert_same_bits(torch.cat([x + y for x, y in zip(a.split(7), b.split(7))]), full,
                     'torch.cat([x + y for x, y in zip(a.split(7), b....')
    assert_same_bits(torch.stack([a[i] + b[i] for i in range(0, 1003, 97)]), full[::97],
                     'torch.stack([a[i] + b[i] for i in range(0, 1003...')
    assert_same_bits(torch.stack([a, b], -1)[:, 0] + torch.stack([b, a], -1)[:, 0], full,
                     'torch.stack([a, b], -1)[:, 0] + torch.stack([b,...')


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), leaf_len=st.integers(1, 40), log_leaves=st.integers(0, 4),
       pad=st.integers(0, 9))
def test_leaf_tree_sum_shape_properties(rows, leaf_len, log_leaves, pad):
    leaves = 1 << log_leaves
    x = _wide(rows, leaves * leaf_len)
    whole = leaf_tree_sum(x, leaves)
    assert whole.shape == (rows,)
    assert_same_bits(leaf_tree_sum(x[-1:], leaves), whole[-1:], 'leaf_tree_sum(x[-1:], leaves)')
    # One leaf's chain is padding-invariant: zero-padding a row never changes its sum.
    row = x[:, :leaf_len]
    assert_same_bits(leaf_tree_sum(torch.nn.functional.pad(row, (0, pad)), 1), leaf_tree_sum(row, 1),
                     'leaf_tree_sum(torch.nn.functional.pad(row, (0, ...')
