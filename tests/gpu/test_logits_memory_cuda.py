"""Memory of the output layer on CUDA: rounding in the epilogue, chunked cross-entropy, selected rows.

* A product no rank shares (the column-parallel forward, ``dW``) is rounded once in the matmul
  kernel's epilogue: the same bits as the fp32 partial rounded afterwards, and a peak of the
  result's size, not the fp32 partial's (control: the fp32-then-round path peaks at the fp32 size).
* ``linear_cross_entropy`` in token chunks: loss, ``dX`` and ``dW`` bitwise the unchunked
  path's at a Qwen3-0.6B-sized vocabulary, with a lower peak than it and below the fp32 logits.
* The model's ``logits_index`` rows are bitwise those rows of the full logits (control: the
  rows one position earlier differ).
Skips without CUDA.
"""
from __future__ import annotations

import gc

import pytest
import torch

from tpinv.kernels.matmul_route import matmul_partial_cuda
from tpinv.layers import linear_cross_entropy, vocab_parallel_cross_entropy
from tpinv.layers.functions import ColumnParallelMatmul
from tpinv.models import Transformer, get_config
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda"
T, H, V = 8192, 1024, 151936   # tokens, Qwen3-0.6B's hidden size and vocabulary


def rand(*shape, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16).to(DEV)


def peak_bytes(fn):
    """(result, peak bytes above what was allocated before ``fn``)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def test_column_forward_rounds_in_the_epilogue():
    x, w = rand(4096, H), rand(V, H, seed=1, scale=0.05)
    with torch.no_grad():
        y, peak = peak_bytes(lambda: ColumnParallelMatmul.apply(x, w, None, None, 8, True))
        ref, ref_peak = peak_bytes(lambda: matmul_partial_cuda(x, w, 1).to(torch.bfloat16))
    assert_same_bits(y, ref, "column forward: epilogue rounding vs fp32 then round")
    out_bytes = y.numel() * y.element_size()
    assert peak <= out_bytes * 1.05, (peak, out_bytes)
    assert ref_peak >= out_bytes * 3 * 0.95, (ref_peak, out_bytes)   # control: fp32 + bf16 copies


@pytest.mark.parametrize("leaves", [1, 8])
def test_epilogue_equals_fp32_then_round_for_every_config(leaves):
    from tpinv.kernels.tiles import CANDIDATE_CONFIGS
    from tpinv.kernels.matmul_route import matmul_cuda
    x, w = rand(300, 512), rand(384, 512, seed=1)
    for cfg in CANDIDATE_CONFIGS:
        assert_same_bits(matmul_cuda(x, w, leaves, config=cfg), matmul_partial_cuda(x, w, leaves, config=cfg)
                         .to(torch.bfloat16), f"bf16 epilogue, leaves={leaves}, {cfg.name()}")


def unchunked(x, w, target, seed_grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(ColumnParallelMatmul.apply(x, w, None, None, 8, True), target)
    loss.backward(seed_grad)
    return loss.detach(), x.grad, w.grad


def chunked(x, w, target, seed_grad, chunk):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(x, w, target, chunk_tokens=chunk)
    loss.backward(seed_grad)
    return loss.detach(), x.grad, w.grad


def test_chunked_cross_entropy_same_bits_and_lower_peak():
    x, w = rand(T, H), rand(V, H, seed=1, scale=0.05)
    target = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(2)).to(DEV)
    seed_grad = torch.rand(T, generator=torch.Generator().manual_seed(3)).to(DEV)
    expected, full_peak = peak_bytes(lambda: unchunked(x, w, target, seed_grad))
    got, chunk_peak = peak_bytes(lambda: chunked(x, w, target, seed_grad, 1024))
    for name, a, b in zip(("loss", "dX", "dW"), got, expected):
        assert_same_bits(a, b, f"chunked vs unchunked: {name}")
    fp32_logits = T * V * 4
    assert chunk_peak < fp32_logits and chunk_peak < full_peak / 2, (chunk_peak, full_peak, fp32_logits)
    print(f"\ncross-entropy {T} tokens x {V}: peak {full_peak / 2**30:.2f} GiB unchunked, "
          f"{chunk_peak / 2**30:.2f} GiB in chunks of 1024 tokens")


def test_selected_rows_equal_the_full_logits_rows():
    torch.manual_seed(0)
    model = Transformer(get_config("qwen3-0.6b", num_layers=2)).to(DEV)
    tokens = torch.randint(0, V, (3, 257), generator=torch.Generator().manual_seed(4)).to(DEV)
    last = torch.tensor([[256], [100], [7]], device=DEV)
    with torch.no_grad():
        full = model(tokens)
        rows = model(tokens, logits_index=last)
        early = model(tokens, logits_index=last - 1)
    picked = full.gather(1, last[..., None].expand(-1, -1, full.shape[-1]))
    assert_same_bits(rows, picked, "selected rows vs the full logits' rows")
    assert_bits_differ(early, picked, "control: off-by-one rows")
