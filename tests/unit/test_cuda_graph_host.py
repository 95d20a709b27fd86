"""What a CUDA-graph capture of a decode step needs from the host side, checked on CPU.

A capture cannot read tensor values on the host.  With a capture simulated
(:func:`tpinv.core.capture.capturing` patched to True where it is asked), a decode step of the
invariant model and of the vanilla control reads no tensor value outside the CPU kernels
(which never run on CUDA); the negative control shows the same detector does see the eager
step's checks.  Eager, a decode step reads values twice (the positions' range, the token
ids' range), not once per layer.  The replay itself is checked on CUDA in
``tests/gpu/test_cuda_graph.py``.
"""
from __future__ import annotations

import collections
import traceback

import pytest
import torch

import tpinv.core.capture
import tpinv.models.vanilla
import tpinv.distributed.collective_calls
from tpinv.engine.decode_graph import DecodeGraph
from tpinv.engine import Engine
from tpinv.models import Transformer, get_config
from tpinv.models.vanilla import vanilla_forward
from tpinv.testing import num_threads

HOST_READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")
ASKERS = (tpinv.core.capture, tpinv.models.vanilla, tpinv.distributed.collective_calls)   # where capturing() is asked


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with num_threads(1):
        yield


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(get_config("qwen3-tiny"))


def host_reads(monkeypatch, step) -> collections.Counter:
    """Where ``step()`` reads tensor values on the host, outside ``tpinv/kernels/reference_*``."""
    seen = collections.Counter()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def wrapped(self, *a, __original=original, __name=name, **k):
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            caller = frames[-1]
            if "tpinv/kernels/reference_" not in caller.filename.replace("\\", "/"):
                seen[f"{__name} at {caller.filename.rsplit('/', 2)[-1]}:{caller.lineno}"] += 1
            return __original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, wrapped)
    try:
        step()
    finally:
        monkeypatch.undo()
    return seen


def decode_step(model, forward):
    cache = model.new_cache(2, 16)
    with torch.no_grad():
        forward(torch.tensor([[3, 4, 5], [6, 7, 8]]), None, cache, None)
    token, ones = torch.tensor([[9], [10]]), torch.ones(2, dtype=torch.int64)
    return lambda: forward(token, cache.next_positions(1), cache, ones)


FORWARDS = {"invariant": lambda m: (lambda t, p, c, v: m(t, p, c, num_valid=v)),
            "vanilla": lambda m: (lambda t, p, c, v: vanilla_forward(m, t, p, c, num_valid=v))}


@pytest.mark.parametrize("path", FORWARDS)
def test_a_captured_decode_step_reads_no_tensor_value_on_the_host(model, monkeypatch, path):
    step = decode_step(model, FORWARDS[path](model))
    for module in ASKERS:
        monkeypatch.setattr(module, "capturing", lambda: True)
    with torch.no_grad():
        reads = host_reads(monkeypatch, step)
    assert not reads, f"host reads inside a simulated capture: {dict(reads)}"


def test_negative_control_the_eager_step_reads_values_once_per_check(model, monkeypatch):
    step = decode_step(model, FORWARDS["invariant"](model))
    with torch.no_grad():
        reads = host_reads(monkeypatch, step)
    assert sum(reads.values()) == 2, dict(reads)   # positions and token ids, one transfer each
    assert model.args.num_layers >= 2               # so a per-layer check would show up as more


def test_the_eager_checks_still_reject_bad_input(model):
    cache = model.new_cache(1, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="max_len=4"):
        model(torch.tensor([[1, 2]]), torch.tensor([[3, 4]]), cache)
    with torch.no_grad(), pytest.raises(IndexError, match="outside the vocabulary"):
        model(torch.tensor([[1, model.args.vocab_size]]), cache=model.new_cache(1, 4))
    assert int(cache.lengths[0]) == 0


def test_advance_updates_the_lengths_in_place(model):
    cache = model.new_cache(2, 8)
    lengths = cache.lengths
    cache.advance(torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([3, 1]))
    assert cache.lengths is lengths and lengths.tolist() == [3, 1]


def test_engine_close_without_a_graph_is_harmless(model):
    engine = Engine(model, max_batch=2)
    engine.close()
    assert engine.decode_graph is None


def test_cuda_graphs_are_refused_off_cuda(model):
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Engine(model, max_batch=2, cuda_graph=True)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraph(lambda t, p, v: t, model.new_cache(1, 4), model.args.vocab_size)
