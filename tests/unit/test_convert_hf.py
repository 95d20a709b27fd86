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

from tpinv.io.checkpoint import CheckpointError, load_shard, param_meta_from_module, read_info, shard_index
from tpinv.core.contract import InvarianceError
from tpinv.models.args import ModelArgs
from tpinv.io.hf_convert import convert_hf_to_tpinv, convert_tpinv_to_hf
from tpinv.io.hf_keys import (args_from_dict, args_to_dict, hf_config_from_args, param_meta, param_specs,
                                  to_hf_name)
from tpinv.io.safetensors_stream import SafetensorsReader
from tpinv.testing import assert_bits_differ, assert_same_bits, run_ranks, same_bits
from tpinv.testing.scripts import REPO_ROOT, load_script

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
        assert got[key].dtype == t.dtype, key
        assert_same_bits(got[key], t, str(key))
    assert ModelArgs.from_hf_config(back) == ModelArgs.from_hf_config(src)


def test_round_trip_comparison_can_fail(hf_dirs, tmp_path):
    """Negative control: a cast changes bits, and the tensor-by-tensor comparison sees it."""
    dirs, _ = hf_dirs
    src = dirs["qwen3", False]
    ck = convert_hf_to_tpinv(src, str(tmp_path / "ck"), tp=2, dtype=torch.bfloat16)
    assert read_info(ck).model_args["dtype"] == "bfloat16"
    back = _hf_tensors(convert_tpinv_to_hf(ck, str(tmp_path / "hf"), dtype=torch.float32))
    want = _hf_tensors(src)
    for k in want:
        assert_same_bits(back[k], want[k].to(torch.bfloat16).float(), 'back[k]')
    assert sum(not same_bits(back[k], want[k]) for k in want) >= len(want) - 2
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
        assert_same_bits(model.state_dict()[k], v, str(k))


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
                assert_same_bits(got[name], t[shard_index(t.shape, meta[name], 2, rank)], str(name))
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
    assert sorted(unfused) == sorted(want) and all(same_bits(unfused[k], want[k]) for k in want)


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
    from tpinv.io.checkpoint import save_checkpoint
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
        assert_same_bits(hf_sd[to_hf_name(name_)], t, str(name_))


def _tp_logits(rank, world_size, ck, tokens, swap=False):
    """Logits of the converted checkpoint loaded at TP ``world_size`` (and with the rank shards swapped)."""
    import torch.distributed as dist
    from tpinv.io.hf_keys import args_from_dict as from_dict
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
    assert_same_bits(two[0][0], one, 'two[0][0]')
    assert_same_bits(two[1][0], one, 'two[1][0]')
    assert_bits_differ(two[0][1], one, 'two[0][1]')  # negative control: rank 0 holding rank 1's shard is caught
    with torch.no_grad():
        ref = models["qwen3"](tokens).logits
    torch.testing.assert_close(one, ref, rtol=1e-4, atol=1e-4)  # parity with HF (fp32)


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
    assert sorted(got) == sorted(want) and all(same_bits(got[k], want[k]) for k in want)


# ---- CLI ------------------------------------------------------------------------------------------

def test_cli(hf_dirs, tmp_path):
    convert_hf = load_script("tools/convert_hf.py")
    src = hf_dirs[0]["mistral", True]
    assert convert_hf.main(["to-tpinv", src, str(tmp_path / "ck"), "--tp", "2", "--dtype", "bf16"]) == 0
    assert convert_hf.main(["to-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--max-shard-size", "20KB"]) == 0
    got, want = _hf_tensors(str(tmp_path / "hf")), _hf_tensors(src)
    assert all(got[k].dtype == torch.bfloat16 and same_bits(got[k], want[k].to(torch.bfloat16)) for k in want)
    assert convert_hf.parse_size("4GiB") == 4 * 2**30 and convert_hf.parse_size("20KB") == 20_000
    bad = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "convert_hf.py"), "to-tpinv",
                          str(tmp_path), str(tmp_path / "x"), "--tp", "2"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])), timeout=120)
    assert bad.returncode == 2 and "error:" in bad.stderr and "holds neither tpinv.json" in bad.stderr
    assert not os.path.exists(tmp_path / "x")
