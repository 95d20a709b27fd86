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
