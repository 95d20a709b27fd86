"""``tpinv.compile`` on CUDA: the compiled model computes the eager bits, forward and backward.

A Qwen3-0.6B-shaped model cut to two layers, bf16 on CUDA: the compiled training step's logits,
per-token losses and every parameter gradient == the eager step's, byte for byte, for two
batches of different sizes and for the packed path (explicit positions); the engine's compiled
decode == its eager decode (tokens and log-probs).  Inductor generates Triton code for the glue
between the ``tpinv::`` ops on CUDA (C++ on the CPU): these are the CUDA runs of
``tests/unit/test_compile.py``'s claims.  Control, beside the claim: plain ``torch.compile`` of a
bf16 chain on CUDA differs from eager by construction (``(x + 2**-9) - x`` is 0 when each op
rounds, ``2**-9`` fused in fp32), so the comparison catches a compile that skips a rounding.
Skips without CUDA, and below ``tpinv.compile``'s torch floor.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import tpinv
from tpinv.core.compile import COMPILE_TORCH_FLOOR
from tpinv.core.versions import torch_at_least
from tpinv.engine import Engine, Request
from tpinv.layers import vocab_parallel_cross_entropy
from tpinv.models import Transformer, get_config
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not torch_at_least(COMPILE_TORCH_FLOOR),
                                 reason=f"tpinv.compile needs torch >= {COMPILE_TORCH_FLOOR}")]
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(get_config("qwen3-0.6b", num_layers=2, dtype=torch.bfloat16)).to(DEV)


def _batch(batch: int, seq: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(DEV)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen).to(DEV)
    return tokens, targets


def _run(fn, model, tokens, targets, positions):
    model.zero_grad(set_to_none=True)
    logits, loss = fn(tokens, targets, positions)
    loss.sum().backward()
    return ([("logits", logits.detach()), ("loss", loss.detach())]
            + [(name, p.grad.clone()) for name, p in sorted(model.named_parameters())])


@pytest.mark.parametrize("explicit_positions", [False, True])
def test_compiled_training_step_equals_eager(model, explicit_positions):
    def step(tokens, targets, positions):
        logits = model(tokens, positions)
        return logits, vocab_parallel_cross_entropy(logits, targets)

    compiled = tpinv.compile(step)
    before = counters["stats"]["unique_graphs"]
    for batch, seq, seed in ((2, 256, 1), (3, 192, 2)):
        tokens, targets = _batch(batch, seq, model.args.vocab_size, seed)
        positions = torch.arange(seq, device=DEV).expand(batch, seq).contiguous() if explicit_positions else None
        eager = _run(step, model, tokens, targets, positions)
        got = _run(compiled, model, tokens, targets, positions)
        assert len(got) == len(eager) > 2
        for (name, g), (_, e) in zip(got, eager):
            assert_same_bits(g, e, f"compiled vs eager, batch {batch}x{seq}: {name}")
    assert counters["stats"]["unique_graphs"] > before, "nothing was compiled"


def test_plain_compile_of_a_bf16_chain_differs_on_cuda():
    def glue(x):
        return (x + 2 ** -9) - x

    ones = torch.ones(4, 8, dtype=torch.bfloat16, device=DEV)
    assert_bits_differ(torch.compile(glue, fullgraph=True)(ones), glue(ones),
                       "plain torch.compile of a bf16 chain on CUDA (fused in fp32, rounded once)")
    assert_same_bits(tpinv.compile(glue)(ones), glue(ones), "tpinv.compile of the same chain")


def test_engine_compiled_decode_equals_eager(model):
    def requests():
        return [Request("a", list(range(1, 40)), max_tokens=6, ignore_eos=True, top_logprobs=3),
                Request("b", [7, 8, 9], max_tokens=8, ignore_eos=True)]

    eager = Engine(model, max_batch=2, max_context=64).generate(requests())
    engine = Engine(model, max_batch=2, max_context=64, compile=True)
    compiled = engine.generate(requests())
    assert engine.compiled_decodes > 0
    for e, c in zip(eager, compiled):
        assert c.token_ids == e.token_ids
        assert_same_bits(c.logprobs, e.logprobs, f"{e.request_id}: raw log-probs")
        assert_same_bits(c.sampled_logprobs, e.sampled_logprobs, f"{e.request_id}: sampled log-probs")
    assert_same_bits(compiled[0].top_logprobs, eager[0].top_logprobs, "top log-probs")
