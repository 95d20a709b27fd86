"""A corrupt checkpoint file never loads silently: every loader checks the sha256 of each file
tensor it touches, also when it reads only a slice of it (a TP rank), and names the file."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tpinv.testing import assert_bits_differ, assert_same_bits

from tpinv.io.checkpoint import CheckpointError, load_shard, param_meta_from_module, save_checkpoint
from tpinv.io.loading import load_model
from tpinv.models.configs import get_config
from tpinv.models.transformer import Transformer


def _flip(path: str, name: str, at_fraction: float) -> None:
    """Flip one bit inside tensor ``name`` of a safetensors file (the header stays valid)."""
    data = bytearray(open(path, "rb").read())
    n = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8:8 + n])[name]["data_offsets"]
    data[8 + n + begin + int((end - begin) * at_fraction)] ^= 0x40
    open(path, "wb").write(bytes(data))


def _state():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(8, 16, generator=g), "b": torch.randn(16, generator=g)}, {"w": 1, "b": None}


def test_slice_of_a_corrupt_tensor_is_refused_at_every_rank(tmp_path):
    sd, meta = _state()
    out = save_checkpoint(sd, str(tmp_path / "ck"), model_args={}, param_meta=meta)  # one full file
    _flip(os.path.join(out, "model.safetensors"), "w", 0.1)  # row 0, column 12: TP rank 1 owns it
    for rank in (0, 1):  # rank 0's slice is clean, but the file it reads is not
        with pytest.raises(CheckpointError, match=r"w in .*model.safetensors: sha256 mismatch"):
            load_shard(out, 2, rank, verify=True)
    # control: without verification the corruption is real and reaches rank 1 only
    assert_same_bits(load_shard(out, 2, 0)["w"], sd["w"][:, :8], "rank 0 shard")
    assert_bits_differ(load_shard(out, 2, 1)["w"], sd["w"][:, 8:], "rank 1 shard")


def test_load_model_refuses_a_corrupt_tpinv_checkpoint(tmp_path):
    args = get_config("qwen3-tiny")
    torch.manual_seed(0)
    model = Transformer(args, tp_group=None)
    out = save_checkpoint(model.state_dict(), str(tmp_path / "ck"), model_args=args,
                          param_meta=param_meta_from_module(model))
    load_model(out)  # clean: loads
    name = next(iter(model.state_dict()))
    _flip(os.path.join(out, "model.safetensors"), name, 0.5)
    with pytest.raises(CheckpointError, match=rf"{name} in .*model.safetensors: sha256 mismatch"):
        load_model(out)
