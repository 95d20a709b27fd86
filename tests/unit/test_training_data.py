"""tpinv.training's data: the arithmetic task, DP slices and micro-batches, a JSONL corpus with a
sentencepiece tokenizer (text files: tests/unit/test_data_megatron.py), and the refusal of a TP
size that does not divide the heads."""
from __future__ import annotations

import io
import json

import pytest
import torch

from tpinv.core.contract import InvarianceError
from tpinv.training import ArithmeticTask, TrainConfig, Trainer, dp_slice, make_dataset, micro_batches
from tpinv.training.model import build_model
from tpinv.testing import assert_same_bits

TINY = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=8, micro_batch=4, eval_every=0, warmup=1, lr=1e-2)


# -- data -------------------------------------------------------------------------------------------
def test_arithmetic_rows_mask_and_order():
    task = ArithmeticTask(9, seed=3, digits=2)
    b = task.batch(100, 12)
    assert_same_bits(b.tokens, task.batch(100, 12).tokens, 'b.tokens')  # a function of (seed, index) only
    assert_same_bits(torch.cat([task.batch(100, 5).tokens, task.batch(105, 7).tokens]), b.tokens,
                     'torch.cat([task.batch(100, 5).tokens, task.batc...')
    for r in range(len(b)):
        text = bytes(b.tokens[r].tolist() + [b.targets[r, -1].item()]).decode().rstrip("\0")
        a, rest = text.split("+")
        x, answer = rest.split("=")
        assert int(answer) == int(a) + int(x)
        masked = bytes(b.targets[r][b.loss_mask[r] > 0].tolist()).decode()
        assert masked == answer  # the answer digits and the newline, nothing else
    held = {tuple(divmod(c, task.limit)) for c in task.heldout_pairs}
    assert not held & {task.pair(i) for i in range(3000)}


def test_dp_slices_and_micro_batches_partition_the_batch():
    b = ArithmeticTask(6, seed=1, digits=1).batch(0, 16)
    parts = [mb for d in range(2) for mb in micro_batches(dp_slice(b, d, 2), 4)]
    assert_same_bits(torch.cat([p.tokens for p in parts]), b.tokens, 'torch.cat([p.tokens for p in parts])')
    with pytest.raises(ValueError, match="micro-batches of 3"):
        micro_batches(b, 3)


def test_arithmetic_needs_room_for_the_answer():
    with pytest.raises(ValueError, match="seq_len >= 9"):
        ArithmeticTask(8, seed=0, digits=2)


def test_text_data_with_a_sentencepiece_tokenizer(tmp_path):
    import sentencepiece as spm
    docs = [f"document {i}: the same bits at any tensor parallel size" for i in range(40)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_writer=model, vocab_size=60,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    ds = make_dataset(str(tmp_path / "docs.jsonl"), 16, seed=0, tokenizer=str(tmp_path / "tokenizer.model"),
                      num_samples=8)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    indexed = IndexedDataset(ds.prefixes[0])  # the file preprocessed into the data cache
    assert ds.vocab_size == 60 and [indexed[d].tolist() for d in range(len(docs))] == [sp.encode(d) + [2]
                                                                                        for d in docs]
    trainer = Trainer(TrainConfig(**dict(TINY, data=str(tmp_path / "docs.jsonl"), tokenizer=str(
        tmp_path / "tokenizer.model"), seq_len=16, steps=1)), stream=io.StringIO())
    assert trainer.train_step()["loss_tokens"] == 8 * 16  # the loss on every token


def test_tp_sizes_outside_the_contract_are_refused():
    # TP above the KV heads replicates them (docs/scale-out.md); what the contract refuses is a
    # group that is not a power of two or that does not divide the leaves -- before any build.
    with pytest.raises(InvarianceError, match="power of two"):
        build_model(TrainConfig(**TINY), None, 3, 0)
    with pytest.raises(InvarianceError, match="does not divide leaves=8"):
        build_model(TrainConfig(**TINY), None, 16, 0)
