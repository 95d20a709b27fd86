"""HF <-> tpinv conversion: bitwise round trips, resharding, key maps, bad input, streaming, megatron names."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpinv.checkpoint import CheckpointError, load_shard, param_meta_from_module, read_info, shard_index
from tpinv.contract import InvarianceError
from tpinv.models.args import ModelArgs
from tpinv.models.hf_convert import convert_hf_to_tpinv, convert_tpinv_to_hf
from tpinv.models.hf_keys import (args_from_dict, args_to_dict, hf_config_from_args, param_meta, param_specs,
                                  to_hf_name)
from tpinv.safetensors_stream import SafetensorsReader
from tpinv.testing import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2)
FAMILIES = {
    # Qwen3: q/k norm, tied embeddings (no lm_head in the files), fp32
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(TINY, intermediate_size=192, num_attention_heads=8,
                                                      num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
              torch.float32),
    # Llama: q/k/v/o biases, llama3 RoPE scaling, bf16
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(TINY, intermediate_size=176, num_attention_heads=4,
                                                      num_key_value_heads=4, head_dim=16, attention_bias=True,
                                                      tie_word_embeddings=False, rope_scaling={
                                                          "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}),
              torch.bfloat16),
    # Mistral: sliding window, fp16
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(TINY, intermediate_size=160, num_attention_heads=8,
                                                            num_key_value_heads=4, head_dim=8, sliding_window=5,
                                                            tie_word_embeddings=False), torch.float16),
}


def _hf_model(family: str, seed: int = 0, **overrides):
    import transformers
    cfg_cls, model_cls, kw, dtype = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**dict(kw, **overrides))
    model = getattr(transformers, model_cls)(cfg).to(dtype).eval()
    with torch.no_grad():  # norms start at ones: make them random too, so a swap would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """``{(family, sharded): dir}`` of tiny random HF checkpoints, plus the models."""
    out, models = {}, {}
    for family in FAMILIES:
        model = models[family] = _hf_model(family)
        for sharded in (False, True):
            d = tmp_path_factory.mktemp(f"{family}-{'sharded' if sharded else 'single'}")
            model.save_pretrained(str(d), max_shard_size="20KB" if sharded else "1GB")
            out[family, sharded] = str(d)
    return out, models


def _hf_tensors(d: str) -> dict[str, torch.Tensor]:
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    out = {}
    for f in files:
        out.update(load_file(os.path.join(d, f)))
    return out


def _gone(path: str) -> bool:
    parent, base = os.path.dirname(path), os.path.basename(path)
    return not os.path.exists(path) and not any(n.startswith(base + ".") for n in os.listdir(parent))


# ---- round trips -----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hf_tpinv_hf_round_trip_is_bitwise(hf_dirs, tmp_path, family, sharded, tp):
    dirs, _ = hf_dirs
    src = dirs[family, sharded]
    assert os.path.isfile(os.path.join(src, "model.safetensors.index.json")) == sharded
    ck = convert_hf_to_tpinv(src, str(tmp_path / "ck"), tp=tp)
    info = read_info(ck)
    assert info.tp_size == tp and len([f for f in os.listdir(ck) if f.endswith(".safetensors")]) == tp
    back = convert_tpinv_to_hf(ck, str(tmp_path / "hf"), max_shard_size=30_000 if sharded else 2**30)
    assert os.path.isfile(os.path.join(back, "model.safetensors.index.json")) == sharded
    want, got = _hf_tensors(src), _hf_tensors(back)
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
    assert ModelArgs.from_hf_config(back) == ModelArgs.from_hf_config(src)


def test_round_trip_comparison_can_fail(hf_dirs, tmp_path):
    """Negative control: a cast changes bits, and the tensor-by-tensor comparison sees it."""
    dirs, _ = hf_dirs
    src = dirs["qwen3", False]
    ck = convert_hf_to_tpinv(src, str(tmp_path / "ck"), tp=2, dtype=torch.bfloat16)
    assert read_info(ck).model_args["dtype"] == "bfloat16"
    back = _hf_tensors(convert_tpinv_to_hf(ck, str(tmp_path / "hf"), dtype=torch.float32))
    want = _hf_tensors(src)
    assert all(torch.equal(back[k], want[k].to(torch.bfloat16).float()) for k in want)
    assert sum(not torch.equal(back[k], want[k]) for k in want) >= len(want) - 2
    with open(os.path.join(tmp_path, "hf", "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loaded_by_transformers(hf_dirs, tmp_path, family):
    import transformers
    dirs, models = hf_dirs
    ck = convert_hf_to_tpinv(dirs[family, True], str(tmp_path / "ck"), tp=4)
    back = convert_tpinv_to_hf(ck, str(tmp_path / "hf"))
    model = getattr(transformers, FAMILIES[family][1]).from_pretrained(back, dtype=FAMILIES[family][3])
    for k, v in models[family].state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_reshard_tp4_files_loaded_at_tp2(hf_dirs, tmp_path):
    dirs, _ = hf_dirs
    src = dirs["llama", True]
    args = ModelArgs.from_hf_config(src)
    ck = convert_hf_to_tpinv(src, str(tmp_path / "ck"), tp=4)
    full = {k.removeprefix("model."): v for k, v in _hf_tensors(src).items()}
    for row_strategy in ("tree", "column_only"):
        meta = param_meta(args, row_strategy)
        for rank in range(2):
            got = load_shard(ck, 2, rank, row_strategy, meta)
            assert sorted(got) == sorted(full)
            for name, t in full.items():
                assert torch.equal(got[name], t[shard_index(t.shape, meta[name], 2, rank)]), name
    assert load_shard(ck, 2, 1)["layers.0.self_attn.o_proj.weight"].shape == (64, 32)  # tree: input dim split


def test_fused_qkv_and_gate_up_both_ways(hf_dirs, tmp_path):
    dirs, _ = hf_dirs
    src = dirs["llama", False]
    ck = convert_hf_to_tpinv(src, str(tmp_path / "ck"))
    fused = convert_tpinv_to_hf(ck, str(tmp_path / "fused"), fuse=True)
    tensors = _hf_tensors(fused)
    assert tensors["model.layers.1.self_attn.qkv_proj.weight"].shape == (3 * 64, 64)
    assert tensors["model.layers.1.self_attn.qkv_proj.bias"].shape == (3 * 64,)
    assert tensors["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 176, 64)
    assert "model.layers.0.self_attn.q_proj.weight" not in tensors
    again = convert_hf_to_tpinv(fused, str(tmp_path / "ck2"), tp=2)  # split on load
    unfused = _hf_tensors(convert_tpinv_to_hf(again, str(tmp_path / "hf")))
    want = _hf_tensors(src)
    assert sorted(unfused) == sorted(want) and all(torch.equal(unfused[k], want[k]) for k in want)


def test_side_files_travel(hf_dirs, tmp_path):
    dirs, _ = hf_dirs
    src = str(tmp_path / "src")
    shutil.copytree(dirs["mistral", False], src)
    (tmp_path / "src" / "tokenizer.json").write_text('{"fake": true}')
    ck = convert_hf_to_tpinv(src, str(tmp_path / "ck"))
    back = convert_tpinv_to_hf(ck, str(tmp_path / "hf"))
    assert open(os.path.join(back, "tokenizer.json")).read() == '{"fake": true}'
    assert os.path.isfile(os.path.join(back, "generation_config.json"))


# ---- key maps against the real model ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3-tiny", "llama-tiny", "mistral-tiny"])
@pytest.mark.parametrize("row_strategy", ["tree", "column_only"])
def test_key_map_matches_transformer_parameters(name, row_strategy):
    from tpinv.models.configs import get_config
    from tpinv.models.transformer import Transformer
    args = get_config(name, attention_bias=name == "llama-tiny")
    model = Transformer(args, row_strategy=row_strategy)
    specs = param_specs(args)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: s.shape for k, s in specs.items()}
    assert param_meta_from_module(model) == param_meta(args, row_strategy)
    assert all(to_hf_name(k) == s.hf_name for k, s in specs.items())


def test_model_args_and_config_round_trip():
    from tpinv.models.configs import CONFIGS
    for args in CONFIGS.values():
        assert args_from_dict(json.loads(json.dumps(args_to_dict(args)))) == args
        assert ModelArgs.from_hf_config(hf_config_from_args(args)) == args


@pytest.mark.parametrize("name", ["qwen3-tiny", "llama-tiny", "mistral-tiny"])
def test_trained_model_exports_with_a_derived_config(tmp_path, name):
    """A checkpoint saved from a tpinv model (no HF config stored) exports to a HF directory transformers loads."""
    import transformers
    from tpinv.checkpoint import save_checkpoint
    from tpinv.models.configs import get_config
    from tpinv.models.transformer import Transformer
    args = get_config(name, dtype=torch.bfloat16)
    model = Transformer(args)
    ck = save_checkpoint(model.state_dict(), str(tmp_path / "ck"), model_args=args_to_dict(args),
                         param_meta=param_meta_from_module(model), tp=2)
    assert args_from_dict(read_info(ck).model_args) == args
    hf_dir = convert_tpinv_to_hf(ck, str(tmp_path / "hf"))
    arch = json.load(open(os.path.join(hf_dir, "config.json")))["architectures"][0]
    hf = getattr(transformers, arch).from_pretrained(hf_dir, dtype=torch.bfloat16)
    assert ModelArgs.from_hf_config(hf.config.to_dict()) == args
    hf_sd = hf.state_dict()
    for name_, t in model.state_dict().items():
        assert torch.equal(hf_sd[to_hf_name(name_)], t), name_


def _tp_logits(rank, world_size, ck, tokens, swap=False):
    """Logits of the converted checkpoint loaded at TP ``world_size`` (and with the rank shards swapped)."""
    import torch.distributed as dist
    from tpinv.models.hf_keys import args_from_dict as from_dict
    from tpinv.models.transformer import Transformer
    info = read_info(ck)
    group = dist.group.WORLD if world_size > 1 else None
    model = Transformer(from_dict(info.model_args), tp_group=group)
    meta = param_meta_from_module(model)
    out = []
    for shard in (rank, world_size - 1 - rank) if swap else (rank,):
        model.load_state_dict(load_shard(ck, world_size, shard, "tree", meta), strict=True)
        with torch.no_grad():
            out.append(model(tokens, gather_logits=True))
    return out


def test_converted_checkpoint_runs_the_same_bits_at_tp1_and_tp2(hf_dirs, tmp_path):
    dirs, models = hf_dirs
    ck = convert_hf_to_tpinv(dirs["qwen3", True], str(tmp_path / "ck"), tp=4)
    tokens = torch.randint(0, 256, (2, 7))
    (one,) = _tp_logits(0, 1, ck, tokens)
    two = run_ranks(_tp_logits, 2, ck, tokens, True)
    assert torch.equal(two[0][0], one) and torch.equal(two[1][0], one)
    assert not torch.equal(two[0][1], one)  # negative control: rank 0 holding rank 1's shard is caught
    with torch.no_grad():
        ref = models["qwen3"](tokens).logits
    torch.testing.assert_close(one, ref, rtol=1e-4, atol=1e-4)  # parity with HF (fp32)


# ---- bad input ------------------------------------------------------------------------------------

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
    with pytest.raises(InvarianceError, match="TP=8 exceeds num_kv_heads=4"):
        convert_hf_to_tpinv(d, out, tp=8)
    with pytest.raises(InvarianceError, match="group size 3 is not a power of two"):
        convert_hf_to_tpinv(d, out, tp=3)
    _edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(NotImplementedError, match=r"config.json: architecture \['GPT2LMHeadModel'\] is not supported"):
        convert_hf_to_tpinv(d, out)
    assert _gone(out)


def test_failure_mid_write_leaves_no_output(hf_dirs, tmp_path, monkeypatch):
    from tpinv.safetensors_stream import SafetensorsStreamWriter
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


# ---- streaming ------------------------------------------------------------------------------------

def _fake_hf_dir(d, args: ModelArgs, files: int = 4) -> str:
    """A HF-format checkpoint of random tensors for ``args``, split over ``files`` shards with an index."""
    os.makedirs(d)
    specs = list(param_specs(args).values())
    weight_map = {}
    for f in range(files):
        fname = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        part = {s.hf_name: torch.randn(s.shape).to(torch.bfloat16) for s in specs[f::files]}
        save_file(part, os.path.join(d, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    json.dump(hf_config_from_args(args), open(os.path.join(d, "config.json"), "w"))
    return str(d)


def test_conversion_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    from tpinv.models.configs import get_config
    args = get_config("llama-tiny", num_layers=12, hidden_size=128, intermediate_size=352, dtype=torch.bfloat16)
    src = _fake_hf_dir(tmp_path / "hf", args)
    n = len(param_specs(args))
    refs, peak, count = [], [0], [0]
    real_get = SafetensorsReader.get

    def tracked(self, key, index=None):
        t = real_get(self, key, index)
        refs[:] = [r for r in refs if r() is not None] + [weakref.ref(t)]
        peak[0], count[0] = max(peak[0], len(refs)), count[0] + 1
        return t

    monkeypatch.setattr(SafetensorsReader, "get", tracked)
    ck = convert_hf_to_tpinv(src, str(tmp_path / "ck"), tp=4)
    assert count[0] == 4 * n and peak[0] <= 2, (count[0], peak[0])  # one slice read per tensor per rank file
    peak[0] = count[0] = 0
    back = convert_tpinv_to_hf(ck, str(tmp_path / "back"), max_shard_size=1_000_000)
    assert count[0] >= n and peak[0] <= 4 + 2, peak[0]  # at most one tensor's 4 rank pieces at a time
    assert len([f for f in os.listdir(back) if f.endswith(".safetensors")]) > 1
    monkeypatch.undo()
    want, got = _hf_tensors(src), _hf_tensors(back)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


# ---- CLI ------------------------------------------------------------------------------------------

def test_cli(hf_dirs, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import convert_hf
    finally:
        sys.path.pop(0)
    src = hf_dirs[0]["mistral", True]
    assert convert_hf.main(["to-tpinv", src, str(tmp_path / "ck"), "--tp", "2", "--dtype", "bf16"]) == 0
    assert convert_hf.main(["to-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--max-shard-size", "20KB"]) == 0
    got, want = _hf_tensors(str(tmp_path / "hf")), _hf_tensors(src)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    assert convert_hf.parse_size("4GiB") == 4 * 2**30 and convert_hf.parse_size("20KB") == 20_000
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf.py"), "to-tpinv",
                          str(tmp_path), str(tmp_path / "x"), "--tp", "2"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])), timeout=120)
    assert bad.returncode == 2 and "error:" in bad.stderr and "config.json not found" in bad.stderr
    assert not os.path.exists(tmp_path / "x")


# ---- megatron-core names ----------------------------------------------------------------------------

def _megatron_check(rank, world_size, checkpoints, tokens):
    """In a fresh process: load each converted checkpoint into megatron-core's local-spec GPTModel."""
    import contextlib
    import torch.nn.functional as F
    torch.cuda.current_device = lambda: "cpu"  # megatron-core's CPU path still asks for a device index
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tpinv.checkpoint import load_full
    from tpinv.models.hf_keys import args_from_dict as from_dict
    from tpinv.models.megatron_keys import from_megatron_state_dict, to_megatron_state_dict
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    results = []
    for ck in checkpoints:
        args = from_dict(read_info(ck).model_args)
        cfg = TransformerConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
            num_query_groups=args.num_kv_heads, kv_channels=args.head_dim, ffn_hidden_size=args.intermediate_size,
            normalization="RMSNorm", layernorm_epsilon=args.rms_norm_eps, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=args.attention_bias, add_qkv_bias=args.attention_bias,
            qk_layernorm=args.qk_norm, use_cpu_initialization=True, params_dtype=torch.float32,
            hidden_dropout=0.0, attention_dropout=0.0)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(
            qk_layernorm=args.qk_norm, normalization="RMSNorm"), vocab_size=args.vocab_size, max_sequence_length=64,
            share_embeddings_and_output_weights=args.tie_word_embeddings, position_embedding_type="rope",
            rotary_base=args.rope_theta).eval()
        full = load_full(ck)
        model.load_state_dict(to_megatron_state_dict(full, args), strict=True)
        S = tokens.shape[1]
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]
        with torch.no_grad():
            logits = model(tokens, torch.arange(S).expand_as(tokens), mask)
        back = from_megatron_state_dict(model.state_dict(), args)
        same = sorted(back) == sorted(full) and all(torch.equal(back[k], full[k]) for k in full)
        # The same checkpoint in a GPTModel built with tpinv's spec (tpinv layers throughout).
        from tpinv.megatron import build_gpt_model
        tp_model = build_gpt_model(cfg, tp_group=parallel_state.get_tensor_model_parallel_group(),
                                   vocab_size=args.vocab_size, max_sequence_length=64,
                                   spec_kwargs=dict(qk_layernorm=args.qk_norm, normalization="RMSNorm"),
                                   share_embeddings_and_output_weights=args.tie_word_embeddings,
                                   position_embedding_type="rope", rotary_base=args.rope_theta).eval()
        missing, unexpected = tp_model.load_state_dict(to_megatron_state_dict(full, args), strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
        with torch.no_grad():
            tp_logits = tp_model(tokens, torch.arange(S).expand_as(tokens), mask)
        results.append((logits, same, tp_logits))
    return results


def test_megatron_state_dict_loads_and_matches_hf(tmp_path):
    """megatron-core names, the per-group qkv interleave and [gate; up], checked by running GPTModel."""
    models, checkpoints = {}, []
    for family in ("qwen3", "llama"):  # qwen3: q/k layernorm, tied; llama: biases, untied
        # plain RoPE (megatron's llama3 scaling has fixed constants), 2 query heads per group, fp32
        hf = models[family] = _hf_model(family, 1, rope_scaling=None, num_attention_heads=8,
                                        num_key_value_heads=4).float()
        hf.save_pretrained(str(tmp_path / family))
        checkpoints.append(convert_hf_to_tpinv(str(tmp_path / family), str(tmp_path / f"{family}-ck")))
    tokens = torch.randint(0, 256, (2, 7))
    results = run_ranks(_megatron_check, 1, checkpoints, tokens, timeout=240)[0]
    for (logits, round_trip, tp_logits), (family, hf) in zip(results, models.items()):
        with torch.no_grad():
            ref = hf(tokens).logits
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)  # fp32 parity with HF
        torch.testing.assert_close(tp_logits, ref, rtol=1e-5, atol=1e-5)  # tpinv spec, same checkpoint
        assert round_trip, family


def test_megatron_tp_shards():
    """Rank r's megatron shard: query groups [r*G/C, (r+1)*G/C) of linear_qkv, [gate_r; up_r], fc2 columns."""
    from tpinv.models.configs import get_config
    from tpinv.models.megatron_keys import to_megatron_state_dict
    args = get_config("llama-tiny", num_heads=8, head_dim=8, attention_bias=True)
    full = {n: torch.randn(s.shape) for n, s in param_specs(args).items()}
    g, hd = args.num_kv_heads, args.head_dim
    per = args.num_heads // g * hd
    whole = to_megatron_state_dict(full, args)
    for tp in (2, 4):
        shards = [to_megatron_state_dict(full, args, tp=tp, rank=r) for r in range(tp)]
        for r, sd in enumerate(shards):
            assert sorted(sd) == sorted(whole)
            qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"].view(g // tp, per + 2 * hd, -1)
            groups = slice(r * g // tp, (r + 1) * g // tp)
            assert torch.equal(qkv[:, :per], full["layers.0.self_attn.q_proj.weight"].view(g, per, -1)[groups])
            assert torch.equal(qkv[:, per:per + hd], full["layers.0.self_attn.k_proj.weight"].view(g, hd, -1)[groups])
            assert torch.equal(qkv[:, per + hd:], full["layers.0.self_attn.v_proj.weight"].view(g, hd, -1)[groups])
            gate, up = (full[f"layers.0.mlp.{p}_proj.weight"].chunk(tp)[r] for p in ("gate", "up"))
            assert torch.equal(sd["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate, up]))
            assert torch.equal(sd["decoder.layers.0.mlp.linear_fc2.weight"],
                               full["layers.0.mlp.down_proj.weight"].chunk(tp, 1)[r])
            assert torch.equal(sd["decoder.layers.0.self_attention.linear_proj.bias"],
                               full["layers.0.self_attn.o_proj.bias"])  # replicated
        # concatenating the shards of the qkv rows gives back the whole interleaved tensor
        assert torch.equal(torch.cat([sd["decoder.layers.1.self_attention.linear_qkv.bias"] for sd in shards]),
                           whole["decoder.layers.1.self_attention.linear_qkv.bias"])
