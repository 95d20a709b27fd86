"""What one public softmax-family call puts on the GPU where a row's leaves meet in a cluster.

A 16-bit call whose (dtype, mode) the plan's ``CLUSTERED`` names is one launch: the cluster
kernel, with nothing zeroed before it.  Its staggered starts count arrivals per SM in counters
that every launch leaves at zero (:func:`tpinv.kernels.launch_counters.counters`: one set a
stream, a set of its own for each launch captured into a CUDA graph): every program takes its
arrival back as it exits, so the counts are zero again after each call, eager or replayed.  The bytes of these calls are compared with the row kernel's in
``test_softmax_by_leaves.py``; here only what runs.  Control: with no (dtype, mode) clustered the
ticket kernel runs, and the profiler records the launch that zeroes its slots (``torch.zeros``:
a fill kernel or a memset) before it, so a zeroing missing above is one not launched, not one the
profiler missed.
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tpinv.core.contract import DEFAULT_LEAVES
from tpinv.testing import assert_bits_differ, assert_same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
VOCAB = 151936
#: Device-side records the profiler makes for itself, not launched by the call.
PROFILER_OWN = frozenset({"Activity Buffer Request"})


@pytest.fixture
def clustered_16bit():
    """Skip where the cluster kernel cannot run these calls (not sm_90, no Gluon)."""
    from tpinv.kernels import triton_softmax_leaves
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cluster kernel runs on sm_90 only")
    x = torch.zeros(4, VOCAB, device="cuda", dtype=torch.bfloat16)
    if triton_softmax_leaves.held_module(x, VOCAB // DEFAULT_LEAVES) is None:
        pytest.skip("the held-leaf kernels do not run here (Gluon)")
    from tpinv.kernels import gluon_softmax_plan
    return gluon_softmax_plan


def ops():
    """name -> (the public op, its mode)"""
    from tpinv.kernels import triton_softmax as ts
    return {"logsumexp": (ts.logsumexp_forward_cuda, ts._MODE_STATS),
            "log_softmax": (ts.log_softmax_forward_cuda, ts._MODE_LOG),
            "softmax": (ts.softmax_forward_cuda, ts._MODE_SOFTMAX)}


def arrival_counts(device) -> torch.Tensor:
    """The counters this stream's cluster launches count arrivals in."""
    from tpinv.kernels.gluon_softmax import ARRIVAL_SLOTS
    from tpinv.kernels.launch_counters import counters
    return counters(ARRIVAL_SLOTS, device)


def gpu_activity(fn) -> list[str]:
    """Names of the kernels and memory operations ``fn`` puts on the GPU, in order."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and e.name not in PROFILER_OWN]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["logsumexp", "log_softmax", "softmax"])
@pytest.mark.parametrize("rows", [3, 1024])
def test_a_clustered_call_is_one_launch(clustered_16bit, dtype, name, rows):
    plan = clustered_16bit
    op, mode = ops()[name]
    assert (dtype, mode) in plan.CLUSTERED and plan.HELD_CONFIG[dtype, mode][2] > 0, \
        "the table no longer staggers this clustered call: the test would not see the counts"
    x = torch.randn(rows, VOCAB, device="cuda", dtype=dtype)
    op(x, DEFAULT_LEAVES)              # compiled, and the counts made, before the profile
    names = gpu_activity(lambda: op(x, DEFAULT_LEAVES))
    assert len(names) == 1 and "_softmax_cluster_kernel" in names[0], names
    counts = arrival_counts(x.device)
    assert counts.dtype == torch.int32 and not counts.any(), \
        f"arrivals left counted after {name}: {counts.nonzero().flatten().tolist()}"


def test_counts_are_zero_after_graph_replays(clustered_16bit):
    from tpinv.kernels import launch_counters
    from tpinv.kernels.gluon_softmax import ARRIVAL_SLOTS
    static = torch.randn(64, VOCAB, device="cuda", dtype=torch.bfloat16)
    public = [op for op, _ in ops().values()]
    for op in public:
        op(static, DEFAULT_LEAVES)       # compiled, and the counters' stores made, outside capture
    torch.cuda.synchronize()
    store, used_before = launch_counters._CAPTURED[static.device]
    taken = len(public) * ARRIVAL_SLOTS
    if used_before + taken > store.numel():
        pytest.skip("earlier captures in this process spent the captured counters' store")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [op(static, DEFAULT_LEAVES) for op in public]
    used = launch_counters._CAPTURED[static.device][1]
    assert used == used_before + taken, "each captured launch took counters of its own"
    graph.replay()                       # on the capture's values
    first = [out.clone() for out in outs]
    # new values a fresh draw shifted by 4: every output's bytes move by construction (a bf16
    # logsumexp of two standard-normal rows of this width lies within one rounding step)
    static.copy_(torch.randn_like(static) + 4)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert not store[:used].any(), "captured launches leave their counters at 0"
    for out, before, op in zip(outs, first, public):
        assert_same_bits(out, op(static, DEFAULT_LEAVES), f"{op.__name__} replayed on new values")
        assert_bits_differ(out, before, f"control: {op.__name__} of the capture's values")


def test_control_the_ticket_kernel_s_zeroing_is_seen(clustered_16bit, monkeypatch):
    plan = clustered_16bit
    monkeypatch.setattr(plan, "CLUSTERED", frozenset())
    x = torch.randn(1024, VOCAB, device="cuda", dtype=torch.bfloat16)
    op, _ = ops()["log_softmax"]
    op(x, DEFAULT_LEAVES)
    names = gpu_activity(lambda: op(x, DEFAULT_LEAVES))
    held = [i for i, n in enumerate(names) if "_softmax_held_kernel" in n]
    assert len(held) == 1 and held[0] >= 1, names       # the slots' zeroing launched before it
    assert not any("_softmax_cluster_kernel" in n for n in names), names
