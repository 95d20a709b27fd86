"""The output layer on selected rows only (``logits_index``): the rows of the full logits, bitwise.

A logit is the contract's reduction over the hidden size of one hidden row and one weight row,
so the output layer run on a few rows gives those rows of the full logits exactly.  Checked in
one process here (the TP 1/2/4 version: ``tests/distributed/test_logits_memory_tp.py``), with
the control that an off-by-one selection gives other logits; the engine's prefill asks for
one row per request (its logits are ``[B, 1, V]``), and its tokens and log-probs are unchanged.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.engine import Engine, Request, SamplingParams
from tpinv.models import Transformer
from tpinv.testing import assert_bits_differ, assert_same_bits, num_threads, sharpened_model


@pytest.fixture(scope="module")
def model():
    with num_threads(1):
        yield sharpened_model("qwen3-tiny", torch.bfloat16)


def test_selected_rows_equal_full_rows_and_off_by_one_differs(model):
    tokens = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(1))
    index = torch.tensor([[9, 0, 4], [2, 2, 7], [5, 8, 1]])
    with torch.no_grad():
        full = model(tokens)
        rows = model(tokens, logits_index=index)
        shifted = model(tokens, logits_index=index.clamp(min=1) - 1)
    picked = torch.stack([full[b, index[b]] for b in range(3)])
    assert rows.shape == (3, 3, 256)
    assert_same_bits(rows, picked, "selected rows vs the full logits' rows")
    assert_bits_differ(shifted, picked, "control: rows one position earlier")


def test_bad_index_is_refused(model):
    tokens = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="logits_index"):
        model(tokens, logits_index=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="outside"):
        model(tokens, logits_index=torch.tensor([[0], [4]]))


def test_engine_prefill_asks_for_one_row_per_request(model, monkeypatch):
    shapes = []
    forward = Transformer.forward

    def spy(self, tokens, *args, **kwargs):
        out = forward(self, tokens, *args, **kwargs)
        shapes.append((tuple(tokens.shape), kwargs.get("logits_index") is not None, tuple(out.shape)))
        return out
    requests = [Request(f"r{i}", list(range(3 + 2 * i, 9 + 3 * i)), max_tokens=3,
                        sampling=SamplingParams(0.0)) for i in range(3)]
    with num_threads(1):
        before = Engine(model, max_batch=4).generate(requests)
        monkeypatch.setattr(Transformer, "forward", spy)
        after = Engine(model, max_batch=4).generate(requests)
    prefills = [s for s in shapes if s[0][1] > 1]
    assert prefills and all(selected and out[1] == 1 for _, selected, out in prefills), shapes
    for a, b in zip(before, after):
        assert a.token_ids == b.token_ids
        assert_same_bits(a.logprobs, b.logprobs, f"{a.request_id}: log-probs")
