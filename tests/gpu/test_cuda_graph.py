"""A decode step replayed from a CUDA graph gives the eager step's bits, and the prefill's.

A Qwen3-0.6B-shaped model cut to two layers, bf16 on CUDA: greedy decoding with :class:`tpinv.engine.decode_graph.DecodeGraph`
== eager decoding, step by step, and each replayed step == the prefill of the same tokens;
the engine with ``cuda_graph=True`` == without, requests joining mid-flight; a training step
(loss and backward) replayed == eager, for two different batches fed through the same input
buffers.  Negative control: vanilla's decode differs from vanilla's prefill on the same
tokens.  Bad inputs are refused before the replay.  Skips without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from tpinv.core.capture import capture
from tpinv.engine.decode_graph import DecodeGraph
from tpinv.engine import Engine, Request, SamplingParams
from tpinv.models import Transformer, get_config
from tpinv.models.vanilla import vanilla_forward
from tpinv.testing import assert_bits_differ, assert_same_bits, same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = torch.device("cuda")
B, PROMPT, NEW = 3, 300, 6


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(get_config("qwen3-0.6b", num_layers=2, dtype=torch.bfloat16)).to(DEV).eval()


def prompt_tokens(model):
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, model.args.vocab_size, (B, PROMPT + NEW), generator=gen).to(DEV)


def invariant(model):
    return lambda t, p, c, v: model(t, p, c, num_valid=v)


def decode(model, forward, tokens, graph: bool):
    """Teacher-forced decode of tokens[:, PROMPT:], one step each: the logits of every step."""
    cache = model.new_cache(B, PROMPT + NEW + 1, device=DEV)
    forward(tokens[:, :PROMPT], None, cache, None)
    ones = torch.ones(B, dtype=torch.int64, device=DEV)
    run = (lambda t, p, v: forward(t, p, cache, v))
    step = DecodeGraph(run, cache, model.args.vocab_size) if graph else run
    out = [step(tokens[:, i:i + 1], cache.next_positions(1), ones)[:, -1].clone() for i in range(PROMPT, PROMPT + NEW)]
    assert_same_bits(cache.lengths, torch.full((B,), PROMPT + NEW, device=DEV), 'cache.lengths')
    return torch.stack(out, 1), step


def test_replayed_decode_equals_eager_decode_and_prefill(model):
    tokens = prompt_tokens(model)
    with torch.no_grad():
        eager, _ = decode(model, invariant(model), tokens, graph=False)
        replayed, graph = decode(model, invariant(model), tokens, graph=True)
        prefill = model(tokens)[:, PROMPT:]
    assert graph.replays == NEW and graph.graph is not None
    assert_same_bits(replayed, eager, 'replayed')
    assert_same_bits(replayed, prefill, 'replayed')


def test_negative_control_vanilla_decode_differs_from_its_prefill(model):
    tokens = prompt_tokens(model)
    forward = (lambda t, p, c, v: vanilla_forward(model, t, p, c, num_valid=v))
    with torch.no_grad():
        replayed, _ = decode(model, forward, tokens, graph=True)
        prefill = vanilla_forward(model, tokens)[:, PROMPT:]
    assert_bits_differ(replayed, prefill, 'replayed')


def test_engine_with_cuda_graph_equals_eager_engine(model):
    gen = torch.Generator().manual_seed(1)
    reqs = [Request(f"r{i}", torch.randint(0, model.args.vocab_size, (int(n),), generator=gen).tolist(), max_tokens=7,
                    sampling=SamplingParams(0.0) if i % 2 else SamplingParams(0.9, top_k=50, seed=i))
            for i, n in enumerate((5, 17, 9, 30))]
    arrivals = [0, 1, 1, 3]
    eager = Engine(model, max_batch=3, max_context=64).generate(reqs, arrival_steps=arrivals)
    eng = Engine(model, max_batch=3, max_context=64, cuda_graph=True)
    graphed = eng.generate(reqs, arrival_steps=arrivals)
    assert eng.decode_graph.replays > 0
    eng.close()
    assert eng.decode_graph.graph is None
    for a, b in zip(eager, graphed):
        assert a.finish_reason == "length" and len(a.token_ids) == 7, a
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert_same_bits(a.logprobs, b.logprobs, 'a.logprobs')


def test_bad_inputs_are_refused_before_the_replay(model):
    cache = model.new_cache(2, 8, device=DEV)
    step = DecodeGraph(lambda t, p, v: model(t, p, cache, num_valid=v), cache, model.args.vocab_size)
    ok = torch.zeros(2, 1, dtype=torch.int64, device=DEV)
    ones = torch.ones(2, dtype=torch.int64, device=DEV)
    with torch.no_grad():
        with pytest.raises(ValueError, match="token ids must lie"):
            step(ok + model.args.vocab_size, ok, ones)
        with pytest.raises(ValueError, match="positions must lie"):
            step(ok, ok + 8, ones)
        with pytest.raises(ValueError, match="shape"):
            step(ok[:1], ok[:1], ones[:1])
        assert step.graph is None and step.replays == 0
        step(ok, ok, ones)
        assert step.replays == 1 and cache.lengths.tolist() == [1, 1]


def test_replayed_training_step_gives_the_eager_gradients(model):
    gen = torch.Generator().manual_seed(9)
    batches = [torch.randint(0, model.args.vocab_size, (2, 2, 96), generator=gen).to(DEV) for _ in range(2)]
    tokens, targets = (torch.empty_like(batches[0][0]) for _ in range(2))

    def step():
        model.zero_grad(set_to_none=True)
        model.loss(tokens, targets).sum().backward()

    def grads():
        return [p.grad.clone() for p in model.parameters()]

    eager = []
    for b in batches:
        tokens.copy_(b[0]), targets.copy_(b[1])
        step()
        eager.append(grads())
    graph, _ = capture(step)
    for b, want in zip(batches, eager):
        tokens.copy_(b[0]), targets.copy_(b[1])
        graph.replay()
        for g, w in zip(grads(), want):
            assert_same_bits(g, w, 'g')
    assert not all(same_bits(a, b) for a, b in zip(*eager))   # the two batches differ
    model.zero_grad(set_to_none=True)
