"""The embedding's weight gradient on CUDA never waits for the device, and its bits stay the CPU
kernel's.

``tpinv::embedding_backward`` checks its ids on the device (``torch._assert_async``), not by a
host read, so under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing call raises) it
runs and gives the CPU kernel's bytes, with half the tokens marked ``IGNORED_ID`` as the
vocabulary-parallel layer marks other shards' tokens.  Controls: a host read of the ids' range
raises under the same mode, and a bad id stops a child process with a device-side assert.  A training step of a
tiny model synchronizes once, at the model's own input check (the layer's ``IndexError``).
Skips without CUDA.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tpinv.core.capture import value_range
from tpinv.ops import embedding_backward
from tpinv.ops.embedding import IGNORED_ID
from tpinv.testing import assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_backward_makes_no_host_sync_and_keeps_the_cpu_bits():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 37), generator=gen)
    ids = ids.masked_fill(torch.rand(3, 37, generator=gen) < 0.5, IGNORED_ID)  # another shard's tokens
    grad = torch.randn(3, 37, 24, generator=gen).to(torch.bfloat16)
    want = embedding_backward(grad, ids, 50)
    g, i = grad.cuda(), ids.cuda()
    embedding_backward(g, i, 50)   # compiles the kernel outside the mode
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = embedding_backward(g, i, 50)
        with pytest.raises(RuntimeError, match="synchroniz"):
            value_range(i)                                             # control: a host read
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_same_bits(got.cpu(), want, "embedding_backward on CUDA")


def test_a_bad_id_stops_the_process_with_a_device_assert():
    script = textwrap.dedent("""
        import torch
        from tpinv.ops import embedding_backward
        ids = torch.tensor([[1, 2, 50]], device="cuda")
        out = embedding_backward(torch.ones(1, 3, 8, device="cuda"), ids, 50)
        torch.cuda.synchronize()
        print("NOT REACHED")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "NOT REACHED" not in run.stdout
    assert "device-side assert" in run.stderr or "Assertion" in run.stderr, run.stderr[-2000:]


def test_a_training_step_synchronizes_once_at_the_input_check():
    from tpinv.models import Transformer, get_config
    from tpinv.models.replayed_layer import replay_counts
    from tpinv.testing.syncs import training_step_syncs
    torch.manual_seed(0)
    model = Transformer(get_config("qwen3-tiny", dtype=torch.bfloat16)).cuda()
    tokens = torch.randint(0, model.args.vocab_size, (2, 16)).cuda()
    before = replay_counts()["replay"]
    syncs, control = training_step_syncs(model, tokens, tokens)
    assert replay_counts()["replay"] - before == 2 * len(model.layers)   # the steps counted were replayed
    assert len(syncs) == 1, syncs
    # control: one host read more is one synchronization more
    assert len(control) == 2, control
