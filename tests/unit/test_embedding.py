"""tpinv.ops.embedding: exact lookup; each row's gradient is the token-order fp32 chain.

Negative controls: in fp32, PyTorch's CPU ``F.embedding`` backward happens to add a row's
gradients sequentially in token order too, so it matches the fixed chain; the control
there sums the same gradients in reversed token order and shows the bits change.  In
bf16/fp16 ``F.embedding``'s backward itself gives different bits.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from tpinv.testing import assert_bits_differ, assert_same_bits, num_threads
from tpinv.kernels import reference_embedding
from tpinv.kernels.reference_embedding import embedding_backward_reference
from tpinv.ops import embedding, embedding_backward
from tpinv.ops.embedding import IGNORED_ID, embedding_backward_op, embedding_op
from tpinv.ops.registry import cuda_kernel, has_cuda_kernel
from tpinv.testing import record_ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def duplicate_heavy(shape, rows, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, shape, generator=gen)
    grad = torch.randn(*shape, dim, generator=gen).to(dtype)
    return ids, grad


def reversed_chain(grad, ids, rows):
    return embedding_backward_reference(grad.reshape(-1, grad.shape[-1]).flip(0), ids.reshape(-1).flip(0), rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lookup_is_exact(dtype):
    weight = torch.randn(50, 24).to(dtype)
    ids = torch.randint(0, 50, (3, 17))
    out = embedding(ids, weight)
    assert out.shape == (3, 17, 24) and out.dtype == dtype
    assert_same_bits(out, F.embedding(ids, weight), 'out')
    assert_same_bits(embedding(ids.int(), weight), out, 'embedding(ids.int(), weight)')
    assert embedding(torch.zeros(0, dtype=torch.long), weight).shape == (0, 24)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_is_the_token_order_chain(dtype):
    ids, grad = duplicate_heavy((4, 300), 7, 33, dtype)
    got = embedding_backward(grad, ids, 9)
    assert got.shape == (9, 33) and got.dtype == dtype
    assert_same_bits(got, embedding_backward_reference(grad, ids, 9), 'got')
    assert_same_bits(got[7:], torch.zeros(2, 33, dtype=dtype), 'got[7:]')     # rows never hit


def test_backward_control_fp32_order_matters():
    ids, grad = duplicate_heavy((4, 300), 7, 33, torch.float32)
    ours = embedding_backward(grad, ids, 9)
    weight = torch.zeros(9, 33, requires_grad=True)
    F.embedding(ids, weight).backward(grad)
    assert_same_bits(weight.grad, ours, 'weight.grad')          # stated above: CPU F.embedding is sequential
    assert_bits_differ(reversed_chain(grad, ids, 9), ours, 'reversed_chain(grad, ids, 9)')


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_control_16bit_vanilla_differs(dtype):
    ids, grad = duplicate_heavy((4, 300), 7, 33, dtype)
    weight = torch.zeros(9, 33, dtype=dtype, requires_grad=True)
    F.embedding(ids, weight).backward(grad)
    assert_bits_differ(weight.grad, embedding_backward(grad, ids, 9), 'weight.grad')


@pytest.mark.parametrize("dtype", DTYPES)
def test_ignored_ids_add_to_no_row(dtype):
    """Tokens with id -1 (another shard's, in the vocabulary-parallel layer) are the same bits as
    tokens left out; control: giving one of them a real id changes that row."""
    ids, grad = duplicate_heavy((4, 300), 7, 33, dtype)
    gen = torch.Generator().manual_seed(3)
    drop = torch.rand(ids.shape, generator=gen) < 0.6
    marked = ids.masked_fill(drop, IGNORED_ID)
    got = embedding_backward(grad, marked, 9)
    kept = ~drop.reshape(-1)
    want = embedding_backward(grad.reshape(-1, 33)[kept], ids.reshape(-1)[kept], 9)
    assert_same_bits(got, want, 'ignored ids == left out')
    assert_same_bits(embedding_backward_reference(grad, marked, 9), want, 'the loop reference')
    assert_same_bits(embedding_backward(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), 3),
                     torch.zeros(3, 4), 'no tokens')
    assert_same_bits(embedding_backward(grad[:1, :2], torch.full((1, 2), IGNORED_ID), 9),
                     torch.zeros(9, 33, dtype=dtype), 'every token ignored')
    first = int(drop.reshape(-1).nonzero()[0, 0])
    again = marked.reshape(-1).clone()
    again[first] = 2
    assert_bits_differ(embedding_backward(grad, again.reshape(ids.shape), 9)[2], got[2], 'row 2')


@pytest.mark.parametrize("dtype", DTYPES)
def test_autograd_uses_the_fixed_chain(dtype):
    ids, grad = duplicate_heavy((2, 5, 40), 11, 16, dtype)
    weight = torch.randn(13, 16).to(dtype).requires_grad_(True)
    with record_ops() as log:
        embedding(ids, weight).backward(grad)
    assert "tpinv::embedding" in log and "tpinv::embedding_backward" in log
    assert "aten::index_add" not in log and "aten::embedding_dense_backward" not in log
    assert_same_bits(weight.grad, embedding_backward_reference(grad, ids, 13), 'weight.grad')


def test_rows_do_not_depend_on_batch_composition():
    # Sequence A hits rows [0, 20), B rows [20, 40).  Interleaving B's tokens anywhere keeps
    # A's token order, so A's rows get the same bits alone, first, last or interleaved.
    gen = torch.Generator().manual_seed(1)
    a_ids = torch.randint(0, 20, (500,), generator=gen)
    b_ids = torch.randint(20, 40, (300,), generator=gen)
    a_g, b_g = torch.randn(500, 16, generator=gen), torch.randn(300, 16, generator=gen)
    alone = embedding_backward(a_g, a_ids, 40)
    slots = torch.randperm(800, generator=gen)
    a_pos, b_pos = slots[:500].sort().values, slots[500:].sort().values
    mixed_ids = torch.empty(800, dtype=torch.long)
    mixed_g = torch.empty(800, 16)
    mixed_ids[a_pos], mixed_ids[b_pos] = a_ids, b_ids
    mixed_g[a_pos], mixed_g[b_pos] = a_g, b_g
    for ids, g in ((torch.cat([a_ids, b_ids]), torch.cat([a_g, b_g])),
                   (torch.cat([b_ids, a_ids]), torch.cat([b_g, a_g])),
                   (mixed_ids, mixed_g)):
        batch = embedding_backward(g, ids, 40)
        assert_same_bits(batch[:20], alone[:20], 'batch[:20]')
        assert_same_bits(batch[20:], embedding_backward(b_g, b_ids, 40)[20:], 'batch[20:]')
    # Control: the same tokens in another order (reversed) give other bits.
    assert_bits_differ(reversed_chain(mixed_g, mixed_ids, 40)[:20], alone[:20],
                       'reversed_chain(mixed_g, mixed_ids, 40)[:20]')


def test_threads_do_not_change_bits():
    ids, grad = duplicate_heavy((8, 512), 30, 64, torch.float32)
    with num_threads(1):
        one = embedding_backward(grad, ids, 30)
    with num_threads(2):
        two = embedding_backward(grad, ids, 30)
    assert_same_bits(one, two, 'one')


def test_many_duplicates_stay_fast():
    """The work grows with the longest run of one id (vectorised over ids), not with the token
    count: counted in dispatched ops, so the check does not depend on the machine or its load."""
    ids, grad = duplicate_heavy((16, 1024), 40, 128, torch.bfloat16)   # ~410 steps
    steps = int(torch.bincount(ids.reshape(-1)).max())
    assert 16 * steps < ids.numel()           # so the bound below rules out a per-token loop
    with record_ops() as log:
        reference_embedding.embedding_backward(grad, ids, 40)
    assert len(log) < 16 * steps, f"{len(log)} ops for {steps} steps"
    got = embedding_backward(grad, ids, 40)
    first = (ids.reshape(-1) == 3).nonzero()[:, 0]
    chain = torch.zeros(128)
    for t in first.tolist():
        chain = chain + grad.reshape(-1, 128)[t].float()
    assert_same_bits(got[3], chain.to(torch.bfloat16), 'got[3]')


def test_bad_inputs_raise_clear_errors():
    weight = torch.randn(10, 4)
    with pytest.raises(IndexError, match=r"embedding id 10 is out of range .* num_rows=10"):
        embedding(torch.tensor([1, 10, 3]), weight)
    with pytest.raises(IndexError, match=r"embedding id -1 is out of range .* num_rows=10"):
        embedding(torch.tensor([-1, 2]), weight)          # IGNORED_ID is a backward id only
    with pytest.raises(IndexError, match=r"embedding id -2 is out of range .* expected every id in \[-1, 10\)"):
        embedding_backward(torch.randn(2, 4), torch.tensor([-2, 2]), 10)
    with pytest.raises(TypeError, match="integer dtype"):
        embedding(torch.tensor([1.0]), weight)
    with pytest.raises(ValueError, match=r"shape \[num_rows, dim\], got shape \[10\]"):
        embedding(torch.tensor([1]), weight[:, 0])
    with pytest.raises(ValueError, match=r"expected grad \[2, 3, dim\]"):
        embedding_backward(torch.randn(6, 4), torch.zeros(2, 3, dtype=torch.long), 10)
    with pytest.raises(TypeError, match="float64"):
        embedding_backward(torch.randn(2, 4, dtype=torch.float64), torch.tensor([0, 1]), 10)


def test_opcheck():
    ids = torch.randint(0, 6, (3, 5))
    torch.library.opcheck(embedding_op, (ids, torch.randn(6, 4, requires_grad=True)))
    torch.library.opcheck(embedding_backward_op, (torch.randn(3, 5, 4), ids, 6))


