"""HF -> tpinv conversion refuses bad input with an error naming the file/key and leaves no output."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_convert_hf import FAMILIES, _gone, _hf_model, _hf_tensors, hf_dirs  # noqa: F401  (hf_dirs is a fixture)
from tpinv.io.checkpoint import CheckpointError, read_info
from tpinv.core.contract import InvarianceError
from tpinv.io.hf_convert import convert_hf_to_tpinv, convert_tpinv_to_hf


def _copy(src: str, dst) -> str:
    shutil.copytree(src, str(dst))
    return str(dst)


def _edit_config(d: str, **changes) -> None:
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def _shard_of(d: str, key: str) -> str:
    return json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"][key]


def test_shape_mismatch_names_key_file_and_config(hf_dirs, tmp_path):
    d = _copy(hf_dirs[0]["qwen3", True], tmp_path / "in")
    key = "model.layers.1.self_attn.q_proj.weight"
    fname = _shard_of(d, key)
    tensors = load_file(os.path.join(d, fname))
    tensors[key] = tensors[key][:-8].contiguous()
    save_file(tensors, os.path.join(d, fname), metadata={"format": "pt"})
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match=rf"{key} in {fname} has shape \(120, 64\), "
                                              rf"expected \(128, 64\) from config.json"):
        convert_hf_to_tpinv(d, out, tp=2)
    assert _gone(out)
    _edit_config(d, intermediate_size=200)  # config disagrees with every MLP tensor
    with pytest.raises(CheckpointError, match=r"mlp.down_proj.weight in .* has shape \(64, 192\), expected \(64, 200\)"):
        convert_hf_to_tpinv(d, out)
    assert _gone(out)


@pytest.mark.parametrize("case", ["missing_shard", "truncated", "not_in_file", "missing_key", "extra_key",
                                  "extra_layer", "no_config", "bin_only"])
def test_bad_hf_input_raises_naming_the_culprit(hf_dirs, tmp_path, case):
    sharded = case in ("missing_shard", "truncated", "not_in_file")
    d = _copy(hf_dirs[0]["llama", sharded], tmp_path / "in")
    key = "model.layers.1.mlp.up_proj.weight"
    if case == "missing_shard":
        fname = _shard_of(d, key)
        os.remove(os.path.join(d, fname))
        match = rf"{fname}, listed in model.safetensors.index.json for .*, is missing"
    elif case == "truncated":
        fname = _shard_of(d, key)
        path = os.path.join(d, fname)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) - 100])
        match = rf"{fname} is truncated or corrupt"
    elif case == "not_in_file":
        index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
        index["weight_map"]["model.layers.0.mlp.ghost.weight"] = _shard_of(d, key)
        json.dump(index, open(os.path.join(d, "model.safetensors.index.json"), "w"))
        match = r"model.layers.0.mlp.ghost.weight, listed in model.safetensors.index.json, is missing from"
    elif case in ("missing_key", "extra_key"):
        path = os.path.join(d, "model.safetensors")
        tensors = load_file(path)
        if case == "missing_key":
            del tensors[key]
            match = rf"is missing 1 key\(s\) that config.json implies: \['{key}'\]"
        else:
            tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
            match = r"unexpected key model.layers.0.mlp.extra.weight in model.safetensors"
        save_file(tensors, path, metadata={"format": "pt"})
    elif case == "extra_layer":
        _edit_config(d, num_hidden_layers=1)
        match = r"unexpected key model.layers.1\..* in model.safetensors: .*num_layers=1"
    elif case == "no_config":
        os.remove(os.path.join(d, "config.json"))
        match = r"config.json not found"
    else:
        os.remove(os.path.join(d, "model.safetensors"))
        open(os.path.join(d, "pytorch_model.bin"), "wb").close()
        match = r"found \['pytorch_model.bin'\]: convert .bin weights to safetensors"
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match=match):
        convert_hf_to_tpinv(d, out, tp=2)
    assert _gone(out)


def test_unsupported_architecture_and_tp(hf_dirs, tmp_path):
    d = _copy(hf_dirs[0]["mistral", False], tmp_path / "in")
    out = str(tmp_path / "out")
    with pytest.raises(InvarianceError, match="group size 16 does not divide leaves=8"):
        convert_hf_to_tpinv(d, out, tp=16)
    with pytest.raises(InvarianceError, match="group size 3 is not a power of two"):
        convert_hf_to_tpinv(d, out, tp=3)
    _edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(NotImplementedError, match=r"config.json: architecture \['GPT2LMHeadModel'\] is not supported"):
        convert_hf_to_tpinv(d, out)
    assert _gone(out)


def test_failure_mid_write_leaves_no_output(hf_dirs, tmp_path, monkeypatch):
    from tpinv.io.safetensors_stream import SafetensorsStreamWriter
    real, calls, fail_at = SafetensorsStreamWriter.write, [], [25]

    def failing(self, name, tensor):
        calls.append(name)
        if len(calls) == fail_at[0]:
            raise OSError("disk full")
        return real(self, name, tensor)

    monkeypatch.setattr(SafetensorsStreamWriter, "write", failing)
    out = str(tmp_path / "out")
    with pytest.raises(OSError, match="disk full"):
        convert_hf_to_tpinv(hf_dirs[0]["qwen3", True], out, tp=2)
    assert _gone(out) and len(calls) == 25  # failed at the start of the second rank file
    monkeypatch.undo()
    ck = convert_hf_to_tpinv(hf_dirs[0]["qwen3", True], str(tmp_path / "ck"), tp=2)
    monkeypatch.setattr(SafetensorsStreamWriter, "write", failing)
    calls.clear()
    fail_at[0] = 12  # of 24 tensors, in the third or so HF shard file
    with pytest.raises(OSError, match="disk full"):
        convert_tpinv_to_hf(ck, out, max_shard_size=20_000)
    assert _gone(out)


def test_corrupt_tpinv_checkpoint_is_caught_on_export(hf_dirs, tmp_path):
    ck = convert_hf_to_tpinv(hf_dirs[0]["llama", False], str(tmp_path / "ck"), tp=2)
    path = os.path.join(ck, "model-tp2-rank01.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x01  # the last tensor's data (lm_head.weight's rank-1 piece)
    open(path, "wb").write(bytes(data))
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match="lm_head.weight in model-tp2-rank01.safetensors: sha256 mismatch"):
        convert_tpinv_to_hf(ck, out)
    assert _gone(out)
    open(path, "wb").write(bytes(data[:-64]))
    with pytest.raises(CheckpointError, match="model-tp2-rank01.safetensors is truncated or corrupt"):
        convert_tpinv_to_hf(ck, out)
    assert _gone(out)


