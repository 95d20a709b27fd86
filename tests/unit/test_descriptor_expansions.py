"""Launcher expansions of host TMA descriptors (:func:`tpinv.kernels.descriptors.expand_descriptors`):
host logic, with a stand-in for Triton's ``make_tensordesc_arg``.

Checked: each position gets the expansion for its own parameter's metadata, also where one
descriptor fills several parameters, and repeated launches expand nothing once every
(descriptor, metadata) pair is kept.  Control: a new descriptor object is expanded.  On a GPU,
``tests/gpu/test_bound_launch.py`` checks the same with the matmul kernels and Triton's expander.
"""
from __future__ import annotations

from tpinv.kernels import descriptors


class _Descriptor:
    """A stand-in descriptor: any object that takes attributes."""


def test_kept_per_parameter_metadata(monkeypatch):
    calls = []

    def fake_expander(desc, meta):
        calls.append((desc, meta))
        return [("expanded", id(desc), meta["name"])]

    monkeypatch.setattr(descriptors, "_EXPANDER", [fake_expander])
    x, w = _Descriptor(), _Descriptor()
    m_x, m_w, m_w2, m_out = ({"name": n} for n in ("x", "w", "w2", "out"))
    # x fills its own parameter and stands in for the unused output; w fills two parameters
    full = (x, w, w, 7, x)
    meta = ((0, m_x), (1, m_w), (2, m_w2), (4, m_out))
    want = [("expanded", id(x), "x"), ("expanded", id(w), "w"), ("expanded", id(w), "w2"), 7,
            ("expanded", id(x), "out")]
    before = descriptors.descriptor_expansions()
    assert descriptors.expand_descriptors(full, meta) == want
    assert len(calls) == 4 and descriptors.descriptor_expansions() == before + 4
    for _ in range(3):
        assert descriptors.expand_descriptors(full, meta) == want
    assert len(calls) == 4, "kept expansions were built again"
    # control: a new descriptor object in x's place is expanded, once per parameter it fills
    moved = _Descriptor()
    descriptors.expand_descriptors((moved, w, w, 7, moved), meta)
    assert len(calls) == 6 and calls[-2:] == [(moved, m_x), (moved, m_out)]


def test_only_a_missing_context_is_retried(monkeypatch):
    """:func:`descriptors.on_cuda_context` retries a call once, after making a context current, only
    where it failed for want of one; any other error is raised at once, the call made once.  (On a
    GPU, ``tests/gpu/test_fresh_thread.py`` runs the real case.)"""
    import pytest
    import torch

    synced = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(1))

    def failing_once(message):
        calls = []

        def call():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError(message)
            return "ran"
        return call, calls

    call, calls = failing_once("Triton Error [CUDA]: Failed to create tensor map descriptor: "
                               "invalid device context")
    assert descriptors.on_cuda_context(call) == "ran" and len(calls) == 2 and synced == [1]
    call, calls = failing_once("CUDA error: an illegal memory access was encountered (context lost)")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        descriptors.on_cuda_context(call)
    assert len(calls) == 1 and synced == [1]          # control: no retry, no synchronize
