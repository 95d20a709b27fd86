"""Converter faults: an integer weight is refused (never cast silently), a tied config's stored
``lm_head`` that differs from the embedding is refused (never dropped silently), and an
unwritable output gives one ``error:`` line, not a traceback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_convert_hf import _gone, hf_dirs  # noqa: F401  (hf_dirs is a fixture)
from tpinv.io.checkpoint import CheckpointError
from tpinv.io.hf_convert import convert_hf_to_tpinv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _single(hf_dirs, tmp_path, family="qwen3") -> str:
    d = str(tmp_path / "in")
    shutil.copytree(hf_dirs[0][family, False], d)
    return d


def test_integer_weight_is_refused(hf_dirs, tmp_path):
    d = _single(hf_dirs, tmp_path)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    key = "model.layers.0.mlp.up_proj.weight"
    tensors[key] = tensors[key].round().to(torch.int64)
    save_file(tensors, path, metadata={"format": "pt"})
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match=rf"{key} in model.safetensors is int64; model weights must be "
                                              r"floating point"):
        convert_hf_to_tpinv(d, out, dtype=torch.bfloat16)
    assert _gone(out)


def test_tied_config_with_a_different_lm_head_is_refused(hf_dirs, tmp_path):
    d = _single(hf_dirs, tmp_path)  # qwen3 tiny: tie_word_embeddings=true, no lm_head stored
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed.clone()
    save_file(tensors, path, metadata={"format": "pt"})
    convert_hf_to_tpinv(d, str(tmp_path / "same"))  # an exact copy of the embedding: dropping it loses nothing
    tensors["lm_head.weight"] = embed + 1
    save_file(tensors, path, metadata={"format": "pt"})
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match="lm_head.weight in model.safetensors differs from "
                                              "model.embed_tokens.weight, but config.json sets tie_word_embeddings"):
        convert_hf_to_tpinv(d, out)
    assert _gone(out)


def test_unwritable_output_is_one_error_line(hf_dirs, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf.py"), "to-tpinv",
                           hf_dirs[0]["qwen3", False], str(blocker / "out"), "--no-progress"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and "file/out" in proc.stderr, proc.stderr
