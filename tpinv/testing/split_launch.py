"""The chunks-in-parallel attention launch checked as one unit, under Triton's interpreter and on
the GPU alike (:mod:`tpinv.kernels.triton_attention_split`).

:func:`assert_split_launch` runs a split launch into NaN-filled outputs and asserts, on raw bytes,
that it wrote the one-program forward's ``out`` and ``lse``, that it left its pairs' counters at
zero, and that merging its written states again gives the same bytes.  Its control presets a
counter to the number of programs that count in, so no program is elected to merge and the
outputs stay NaN (different by construction).  With ``gluon=True`` the launch is the Gluon
kernel's (:mod:`tpinv.kernels.gluon_attention_decode`), its states merged again by the Triton
kernel, and the control runs the Gluon launch itself."""
from __future__ import annotations

import torch

from tpinv.kernels.launch_counters import counters
from tpinv.testing.bits import assert_same_bits

__all__ = ["assert_split_launch"]


def assert_split_launch(launch, want: tuple, n_pairs: int, gluon=None):
    """Check the split launch ``launch`` (a ``SplitLaunch``) against the one-program forward's
    ``want = (out, lse)``; ``n_pairs`` is its (batch row x kv head) count; ``gluon`` as
    ``split_forward_cuda``'s.  Returns ``(out, lse, acc_st, ml_st)``: its outputs and the chunk
    states it merged, for the caller's own controls."""
    from tpinv.kernels import triton_attention_split as sp
    want_out, want_lse = want
    nan = float("nan")
    # NaN first: a launch whose last program never merged leaves them (differs by construction)
    out, lse = torch.full_like(want_out, nan), torch.full_like(want_lse, nan)
    acc_st, ml_st = sp.split_forward_cuda(launch, out, lse, gluon)
    assert_same_bits(out, want_out, "the split launch's out")
    assert_same_bits(lse, want_lse, "the split launch's lse")
    count = counters(n_pairs, out.device)  # the set the launches on this stream share
    assert_same_bits(count, torch.zeros_like(count), "launches leave counters at 0")
    out.zero_()
    sp.merge_chunks_cuda(launch, acc_st, ml_st, out, lse)
    assert_same_bits(out, want_out, "merge of the written states")
    # control: a counter not at 0 elects nobody (NaN stays); preset to the programs that count
    # in, so no arrival sees the count it merges at
    programs = acc_st.shape[1] if gluon else 1
    count.fill_(programs)
    out.fill_(nan)
    if gluon:
        sp.split_forward_cuda(launch, out, lse, gluon)
    else:
        sp.merge_chunks_cuda(launch, acc_st, ml_st, out, lse)
    stale = torch.isnan(out).all() and (count == 2 * programs).all()
    count.zero_()
    assert stale, "control: a counter not at 0 still merged"
    return out, lse, acc_st, ml_st
