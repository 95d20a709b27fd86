"""The decoder at TP=1 and TP=2 on two GPUs over NCCL: bitwise equal logits, loss and gradients.

Launches ``tools/gpu_model_tp.py`` under ``torchrun --nproc-per-node 2`` for qwen3-tiny in
bf16 and reads its JSON: gathered logits, per-token loss and every gathered parameter
gradient equal between TP=1 and TP=2; negative control: the vanilla path's logits differ.
Skips without two CUDA devices.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tp1_equals_tp2_on_two_gpus(tmp_path):
    out = tmp_path / "tp.json"
    env = dict(os.environ, PYTHONPATH=ROOT, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(ROOT, "tools", "gpu_model_tp.py"), "--models", "qwen3-tiny", "--seq", "24",
           "--iters", "1", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["logits_equal"] and row["loss_equal"] and row["grad_names_match"]
    assert row["grads_equal"] == row["grads_total"] > 0
    assert row["vanilla_logits_differ"]          # control: cuBLAS + plain all-reduce
