"""torch.compile at TP=2 (gloo): the tree reducer's collectives trace as functional collectives, so
``tpinv.compile`` captures the whole TP=2 model in one graph, forward and backward, and computes
the eager bits on every rank -- and, the model being TP-invariant, the TP=1 eager bits.

The descriptor check of the reducer (every rank passes the same shape) becomes a
``torch._assert_async`` node of the graph; the vocab-parallel embedding's backward sends other
ranks' tokens to a spare row rather than dropping them by a boolean index (a data-dependent
shape the AOT partitioner refuses).  Control: plain ``torch.compile`` of the bf16 model differs
(``tests/unit/test_compile.py`` shows why: a fused cast left unrounded).
"""
from __future__ import annotations

import pytest
import torch

from tpinv.core.versions import torch_at_least

from tpinv.core.compile import COMPILE_TORCH_FLOOR, forced_simdlen

from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks


def _step_outputs(model, step, tokens, targets):
    model.zero_grad(set_to_none=True)
    logits, loss = step(tokens, targets)
    loss.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def _compile_tp(rank, world_size, tokens, targets):
    import torch.distributed as dist

    import tpinv
    from tpinv.layers import vocab_parallel_cross_entropy
    from tpinv.models.configs import get_config
    from tpinv.models.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(get_config("qwen3-tiny", dtype=torch.bfloat16), tp_group=dist.group.WORLD)

    def step(tokens, targets):
        logits = model(tokens, gather_logits=True)
        local = logits.narrow(-1, model.vocab_start, model.args.vocab_size // world_size).contiguous()
        return logits, vocab_parallel_cross_entropy(local, targets, tp_group=dist.group.WORLD)

    eager = _step_outputs(model, step, tokens, targets)
    compiled = _step_outputs(model, tpinv.compile(step), tokens, targets)
    torch._dynamo.reset()
    # plain: without emulate_precision_casts (the vector length pinned under a forced CPU kernel set,
    # as tests/conftest.py does in process)
    simdlen = forced_simdlen()
    plain = _step_outputs(model, torch.compile(step, fullgraph=True, options=None if simdlen is None else
                                               {"cpp.simdlen": simdlen}), tokens, targets)
    return eager, compiled, plain


@pytest.mark.slow
@pytest.mark.skipif(not torch_at_least(COMPILE_TORCH_FLOOR),
                    reason="tpinv.compile needs a newer torch (refused below COMPILE_TORCH_FLOOR)")
def test_tp2_compiled_model_equals_eager_forward_and_backward():
    gen = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 256, (2, 9), generator=gen), torch.randint(0, 256, (2, 9), generator=gen)
    ranks = run_ranks(_compile_tp, 2, tokens, targets, timeout=900)
    for rank, (eager, compiled, plain) in enumerate(ranks):
        assert_same_bits(compiled[0], eager[0], f"rank {rank}: logits")
        assert_same_bits(compiled[1], eager[1], f"rank {rank}: losses")
        for name in eager[2]:
            assert_same_bits(compiled[2][name], eager[2][name], f"rank {rank}: grad of {name}")
        assert_bits_differ(plain[0], eager[0], f"rank {rank}: plain torch.compile logits (casts fused)")
    assert_same_bits(ranks[0][0][0], ranks[1][0][0], "the gathered logits of both ranks")
