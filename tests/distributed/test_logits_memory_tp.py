"""Logits only where needed, at TP 1, 2 and 4 (spawned gloo ranks): the same bits as the full logits.

* Selected rows: the output layer run on each request's last valid position (``logits_index``,
  as the engine's prefill does, with a KV cache and right-padded rows) gives bitwise those rows
  of the full gathered logits, at every TP size and equal across TP sizes.  Control: the rows
  one position earlier (an off-by-one selection) differ -- the comparison can fail.
* Chunked cross-entropy: ``model.loss(..., chunk_tokens=5)`` gives the loss and every parameter
  gradient (gathered) of the unchunked loss, at every TP size, and with sequence parallelism at
  TP 2 and 4.
* Bounded cross-rank partials: with ``PARTIAL_CHUNK_BYTES`` at one byte every fp32 partial
  that crosses ranks is reduced a row at a time; the loss and gradients keep the TP 1 bits.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tpinv.distributed.reduce import all_gather
from tpinv.layers import functions
from tpinv.models import Transformer, get_config
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks

B, S = 3, 8
LENGTHS = [8, 3, 6]   # right-padded prompts of the engine's prefill


def inputs():
    gen = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, 256, (B, S), generator=gen)
    targets = torch.randint(0, 256, (B, S), generator=gen)
    seed_grad = torch.rand(B, S, generator=gen)
    return tokens, targets, seed_grad


def build(name, group, sequence_parallel=False) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(get_config(name, dtype=torch.bfloat16), tp_group=group, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("proj.weight") or pname.endswith("embed_tokens.weight"):
                p.mul_(5.0)   # logits of order one
    return model


def full_grad(p, group):
    if group is None or not getattr(p, "tensor_model_parallel", False):
        return p.grad.detach().clone()
    return all_gather(p.grad.detach().contiguous(), group, dim=p.partition_dim)


def rows_case(model, tokens):
    """Full prefill logits, the last valid rows through ``logits_index``, and the off-by-one rows."""
    lengths = torch.tensor(LENGTHS)
    last = (lengths - 1)[:, None]
    with torch.no_grad():
        full = model(tokens, cache=model.new_cache(B, S), num_valid=lengths, gather_logits=True)
        rows = model(tokens, cache=model.new_cache(B, S), num_valid=lengths, gather_logits=True, logits_index=last)
        early = model(tokens, cache=model.new_cache(B, S), num_valid=lengths, gather_logits=True,
                      logits_index=last - 1)
    return full, rows, early


def loss_case(model, tokens, targets, seed_grad, chunk, group):
    loss = model.loss(tokens, targets, chunk_tokens=chunk)
    loss.backward(seed_grad)
    grads = {n: full_grad(p, group) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def run(rank, world_size):
    torch.set_num_threads(1)
    group = dist.group.WORLD if world_size > 1 else None
    tokens, targets, seed_grad = inputs()
    out = {}
    for name in ("qwen3-tiny", "llama-tiny"):   # tied and separate output weights
        model = build(name, group)
        out[name, "rows"] = rows_case(model, tokens)
        for chunk in (None, 5):
            out[name, "loss", chunk] = loss_case(model, tokens, targets, seed_grad, chunk, group)
        if world_size > 1:
            out[name, "loss-sp"] = loss_case(build(name, group, sequence_parallel=True), tokens, targets,
                                             seed_grad, 5, group)
            saved = functions.PARTIAL_CHUNK_BYTES
            functions.PARTIAL_CHUNK_BYTES = 1   # every cross-rank reduction one row at a time
            try:
                out[name, "loss-rows"] = loss_case(build(name, group), tokens, targets, seed_grad, None, group)
            finally:
                functions.PARTIAL_CHUNK_BYTES = saved
    return out


def check_rows(full, rows, early, where):
    idx = torch.tensor(LENGTHS) - 1
    picked = full[torch.arange(B), idx][:, None]
    assert rows.shape == (B, 1, full.shape[-1]), where
    assert_same_bits(rows, picked, f"{where}: selected rows vs the full logits' rows")
    # control: an off-by-one selection is a different hidden row, so other logits
    assert_bits_differ(early, picked, f"{where}: off-by-one rows vs the full logits' rows")


def check_loss(got, expected, where):
    assert_same_bits(got[0], expected[0], f"{where}: loss")
    assert got[1].keys() == expected[1].keys()
    for n, g in expected[1].items():
        assert_same_bits(got[1][n], g, f"{where}: grad of {n}")


@pytest.mark.slow
def test_selected_rows_and_chunked_loss_at_tp_1_2_4():
    results = {1: run(0, 1)}
    for tp in (2, 4):
        results[tp] = run_ranks(run, tp, timeout=600)[0]
    for tp, out in results.items():
        for name in ("qwen3-tiny", "llama-tiny"):
            check_rows(*out[name, "rows"], f"TP={tp} {name}")
            assert_same_bits(out[name, "rows"][1], results[1][name, "rows"][1], f"TP={tp} vs TP=1 {name}: rows")
            check_loss(out[name, "loss", 5], out[name, "loss", None], f"TP={tp} {name}: chunked vs unchunked")
            check_loss(out[name, "loss", 5], results[1][name, "loss", None], f"TP={tp} chunked vs TP=1 {name}")
            if tp > 1:
                check_loss(out[name, "loss-sp"], results[1][name, "loss", None],
                           f"TP={tp} {name}: chunked with sequence parallelism vs TP=1")
                check_loss(out[name, "loss-rows"], results[1][name, "loss", None],
                           f"TP={tp} {name}: cross-rank partials reduced a row at a time vs TP=1")
