"""Loading replicated KV heads: each TP rank reads its KV head whole from a HF directory or a
tpinv checkpoint (a fake process group stands in for the 8 ranks: loading runs no collective).

Negative control: the plain TP split (``shard_index`` without ``replicas``) gives rank r
``1/8`` of the KV rows -- a different slice -- so the test fails if replication were ignored.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

from tpinv.io.checkpoint import param_meta_from_module, save_checkpoint, shard_index
from tpinv.io.loading import load_model
from tpinv.testing import assert_bits_differ, assert_same_bits

from test_convert_hf import _hf_model, _hf_tensors

TP, KV, HEAD_DIM = 8, 2, 16


def _fake_world(rank: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=TP, store=FakeStore())


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("hf-kv2")
    _hf_model("qwen3", num_key_value_heads=KV).save_pretrained(str(hf_dir))
    full = _hf_tensors(str(hf_dir))
    model, _ = load_model(str(hf_dir))  # TP=1
    ckpt = str(tmp_path_factory.mktemp("tpinv-kv2") / "ckpt")
    save_checkpoint(model.state_dict(), ckpt, model_args=model.args, param_meta=param_meta_from_module(model),
                    tp=TP)  # files split 8 ways: a storage layout, loaded at any TP
    return {"hf": str(hf_dir), "tpinv": ckpt}, full


@pytest.mark.parametrize("kind", ["hf", "tpinv"])
def test_each_rank_reads_its_whole_kv_head(sources, kind):
    dirs, full = sources
    try:
        for rank in (0, 3, 4, 7):
            _fake_world(rank)
            model, _ = load_model(dirs[kind], tp_group=dist.group.WORLD)
            attn = model.layers[0].self_attn
            assert attn.replicas == TP // KV and attn.local_kv_heads == 1
            head = rank // (TP // KV)
            for proj in ("k_proj", "v_proj"):
                want = full[f"model.layers.0.self_attn.{proj}.weight"]
                got = getattr(attn, proj).weight.detach()
                assert_same_bits(got, want[head * HEAD_DIM:(head + 1) * HEAD_DIM], f"{kind} rank {rank} {proj}")
                plain = want[shard_index(want.shape, 0, TP, rank)]  # the control: no replication
                assert_bits_differ(plain, got, f"{kind} rank {rank} {proj}: plain TP split")
            q = full["model.layers.0.self_attn.q_proj.weight"]
            assert_same_bits(attn.q_proj.weight.detach(), q[rank * HEAD_DIM:(rank + 1) * HEAD_DIM], f"{kind} q_proj")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

