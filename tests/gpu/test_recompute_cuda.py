"""Activation recompute on CUDA: the same bits as without it, and less memory.

A Qwen3-0.6B-shaped model cut to four layers and a 16k vocabulary, 8192 tokens, bf16 on CUDA
(Triton kernels; the layers' activations, not the output layer or the parameters' gradients,
set this step's peak, as in a real training step): selective and full
recompute give the loss and every gradient of the run without recompute; a forward drawing from
the CUDA generator (``F.dropout``) keeps its bits under recompute because the generator is
restored, and with ``preserve_rng_state=False`` the gradients differ (control).  The peak CUDA
memory of a training step falls from none to selective to full.  Skips without CUDA.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import tpinv.models.transformer as transformer
from tpinv.models import Transformer, get_config
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = torch.device("cuda")
LAYERS, B, S, VOCAB = 4, 4, 2048, 16384
SETTINGS = {"selective": dict(granularity="selective"),
            "full-uniform-1": dict(granularity="full", method="uniform", num_layers=1),
            "full-block-2": dict(granularity="full", method="block", num_layers=2)}


def _model(recompute=None, torch_dropout=False):
    torch.manual_seed(0)
    args = get_config("qwen3-0.6b", num_layers=LAYERS, vocab_size=VOCAB, dtype=torch.bfloat16)
    model = Transformer(args).to(DEV).train()
    if torch_dropout:
        for layer in model.layers:
            layer.mlp.forward = functools.partial(lambda real, x: F.dropout(real(x), 0.5, True), layer.mlp.forward)
    return model.set_recompute(**recompute) if recompute else model


def _step(model):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.args.vocab_size, (B, S), generator=g).to(DEV)
    targets = torch.randint(0, model.args.vocab_size, (B, S), generator=g).to(DEV)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(5)
    loss = model.loss(tokens, targets).sum()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, peak


def _assert_same(got, ref, what):
    assert_same_bits(got[0], ref[0], f"{what}: loss")
    for name in ref[1]:
        assert_same_bits(got[1][name], ref[1][name], f"{what}: grad of {name}")


def test_recompute_same_bits_and_lower_peak_on_cuda():
    ref = _step(_model())
    peaks = {"none": ref[2]}
    for key, setting in SETTINGS.items():
        got = _step(_model(setting))
        _assert_same(got, ref, key)
        peaks[key] = got[2]
    print("peak CUDA bytes of one training step:", peaks)
    assert peaks["full-uniform-1"] < peaks["full-block-2"] < peaks["none"], peaks
    assert peaks["selective"] <= peaks["none"], peaks


def test_cuda_rng_restored_under_recompute_and_the_control_without_it(monkeypatch):
    ref = _step(_model(torch_dropout=True))
    _assert_same(_step(_model(SETTINGS["full-uniform-1"], torch_dropout=True)), ref, "full with CUDA-RNG dropout")
    monkeypatch.setattr(transformer, "checkpointed", functools.partial(checkpoint, use_reentrant=False,
                                                                       preserve_rng_state=False))
    got = _step(_model(SETTINGS["full-uniform-1"], torch_dropout=True))
    name = "layers.0.mlp.down_proj.weight"
    assert_bits_differ(got[1][name], ref[1][name], f"recompute without RNG restore: grad of {name}")
