"""Hidden dropout of tpinv's models (tpinv.layers.dropout): one mask whatever the split.

The mask of an element is a hash of (seed, site, the row's global sample id, the token's
column, the feature), so a micro-batch's rows and a sequence chunk get the slices of the
whole batch's mask, bit for bit.  Controls: torch's RNG dropout on a micro-batch is not the
rows of its whole-batch mask; the model with dropout differs from the model without it.
Dropout is off in eval mode and in the engine; attention dropout is refused.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpinv.layers.dropout import TokenDropout, dropout_key, keep_mask, token_dropout
from tpinv.models import Transformer, get_config
from tpinv.testing import assert_bits_differ, assert_same_bits

P = 0.1


def _x(dtype=torch.float32):
    return torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_mask_of_micro_batch_and_sequence_chunk_is_the_slice(dtype):
    x, ids, key = _x(dtype), torch.arange(100, 104), dropout_key(7, 4)
    full = token_dropout(x, P, key, ids)
    assert_same_bits(token_dropout(x[2:], P, key, ids[2:]), full[2:], "micro-batch rows 2-3")
    assert_same_bits(token_dropout(x[:, 4:], P, key, ids, first_column=4), full[:, 4:], "sequence chunk 4-7")
    dropped = (full == 0).float().mean().item()
    assert 0.05 < dropped < 0.15, dropped
    kept = full != 0
    assert_same_bits(full[kept], (x / (1 - P))[kept], "kept elements scaled by 1/(1-p)")
    # other sites, seeds and sample ids give other masks
    assert_bits_differ(token_dropout(x, P, dropout_key(7, 5), ids), full, "another site")
    assert_bits_differ(token_dropout(x, P, key, ids + 4), full, "other sample ids")
    # control: torch's RNG dropout on the second micro-batch is not the rows of its whole-batch mask
    torch.manual_seed(3)
    whole = F.dropout(x, P)
    torch.manual_seed(3)
    assert_bits_differ(F.dropout(x[2:], P), whole[2:], "torch dropout on micro-batch rows 2-3")


def test_keep_mask_words_and_errors():
    a = keep_mask(dropout_key(1), (torch.arange(6).view(2, 3),), 0.5)
    assert a.dtype == torch.bool and a.shape == (2, 3)
    with pytest.raises(ValueError, match="at least one word"):
        keep_mask(1, (), 0.5)
    with pytest.raises(ValueError, match="int64 tensor"):
        TokenDropout(P, 1, torch.arange(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        TokenDropout(P, 1, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="hidden_dropout=1.0"):
        TokenDropout(1.0, 1, torch.arange(2))


def _model(p=P, seed=0, **kw):
    torch.manual_seed(seed)
    return Transformer(get_config("qwen3-tiny", dtype=torch.float32), hidden_dropout=p, dropout_seed=11, **kw)


def test_model_dropout_batch_split_eval_and_errors():
    drop, plain = _model(), _model(0.0)
    plain.load_state_dict(drop.state_dict())
    tokens = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))
    ids = torch.arange(20, 24)
    drop.train()
    full = drop(tokens, sample_ids=ids, gather_logits=True)
    split = torch.cat([drop(tokens[:2], sample_ids=ids[:2], gather_logits=True),
                       drop(tokens[2:], sample_ids=ids[2:], gather_logits=True)])
    assert_same_bits(split, full, "two micro-batches vs the whole batch")
    off = plain.train()(tokens, sample_ids=ids, gather_logits=True)
    assert_bits_differ(full, off, "dropout 0.1 vs off (dropout ran)")
    # the rate-0 model ignores sample ids: its training forward is today's
    assert_same_bits(plain(tokens, gather_logits=True), off, "rate 0 with and without sample ids")
    # eval mode: no dropout, no sample ids needed
    assert_same_bits(drop.eval()(tokens, gather_logits=True), plain.eval()(tokens, gather_logits=True),
                     "eval mode: dropout off")
    drop.train()
    with pytest.raises(ValueError, match="needs sample_ids"):
        drop(tokens)
    with pytest.raises(NotImplementedError, match="attention_dropout=0.1"):
        _model(attention_dropout=0.1)
    with pytest.raises(ValueError, match="hidden_dropout=1.5"):
        _model(1.5)


def test_engine_runs_without_dropout():
    from tpinv.engine.engine import Engine
    drop = _model().train()
    engine = Engine(drop, max_batch=2)
    assert not engine.model.training  # the engine's model is in eval mode: no dropout
