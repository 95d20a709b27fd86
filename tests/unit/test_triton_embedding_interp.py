"""The Triton embedding gradient under the Triton interpreter (CPU, fp32 and fp16).

Asserted bitwise against the CPU kernel (the token-order fp32 chain per row): heavy repeats,
ids in any order, rows never hit, a non-contiguous gradient, a batch and its first row alone
(a row's bits depend only on its own tokens).  Negative control: the same gradients added in
another order (reversed tokens) give other bits, so the inputs do see the order.

The checks run in one child process with the interpreter on (:mod:`triton_interp`).
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from triton_interp import checks_of, interpreted_test, main

if __name__ == "__main__":  # the subprocess: interpret before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (3.0 * torch.randn(*shape, generator=gen)).to(dtype)


def ids_of(*shape, high, seed=1):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _kernels():
    from tpinv.kernels import reference_embedding, triton_embedding
    return reference_embedding.embedding_backward, triton_embedding.embedding_backward_cuda


# ------------------------------------------------------------------ checks (run in the subprocess)

def check_equals_the_cpu_chain():
    cpu, gpu = _kernels()
    for dtype in (torch.float32, torch.float16):
        for shape, high, rows, dim in (((4, 37), 5, 9, 300), ((3, 11), 40, 50, 7), ((64,), 1, 3, 260)):
            ids, grad = ids_of(*shape, high=high), rand(*shape, dim, dtype=dtype, seed=2)
            assert_same_bits(gpu(grad, ids, rows), cpu(grad, ids, rows), str((dtype, shape)))


def check_ignored_ids_add_to_no_row():
    cpu, gpu = _kernels()
    ids, grad = ids_of(4, 37, high=5), rand(4, 37, 300, seed=4)
    marked = ids.masked_fill(ids_of(4, 37, high=3, seed=5) == 0, -1)   # about a third ignored
    got = gpu(grad, marked, 9)
    assert_same_bits(got, cpu(grad, marked, 9), 'ignored ids: the CPU chain')
    kept = marked.reshape(-1) >= 0
    assert_same_bits(got, cpu(grad.reshape(-1, 300)[kept], marked.reshape(-1)[kept], 9), 'left out')
    assert_bits_differ(got, gpu(grad, ids, 9), 'control: the same tokens not ignored')


def check_rows_alone_and_views():
    cpu, gpu = _kernels()
    ids, grad = ids_of(5, 23, high=6), rand(5, 23, 33, seed=3)
    full = gpu(grad, ids, 8)
    assert_same_bits(gpu(grad[:1], ids[:1], 8), cpu(grad[:1], ids[:1], 8), 'gpu(grad[:1], ids[:1], 8)')
    wide = rand(5, 23, 66, seed=3)[..., ::2]                  # a strided gradient
    assert_same_bits(gpu(wide, ids, 8), cpu(wide.contiguous(), ids, 8), 'gpu(wide, ids, 8)')
    assert_same_bits(full[6:], torch.zeros(2, 33), 'full[6:]')          # rows never hit are zero


def check_control_another_order_gives_other_bits():
    cpu, gpu = _kernels()
    ids, grad = ids_of(256, high=2), rand(256, 16, seed=4)
    ours = gpu(grad, ids, 2)
    reversed_order = cpu(grad.flip(0), ids.flip(0), 2)
    assert_bits_differ(ours, reversed_order, 'ours')


def check_empty_and_bad_input():
    _, gpu = _kernels()
    assert_same_bits(gpu(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), 3), torch.zeros(3, 4),
                     'gpu(torch.zeros(0, 4), torch.zeros(0, dtype=tor...')
    try:
        gpu(rand(2, 4), torch.tensor([0, 3]), 3)
    except IndexError as e:
        assert "3" in str(e)
    else:
        raise AssertionError("an id outside the table was accepted")


CHECKS = checks_of(dict(globals()))
test_interpreted_kernel = interpreted_test(__file__, CHECKS)

if __name__ == "__main__":
    main(CHECKS)
