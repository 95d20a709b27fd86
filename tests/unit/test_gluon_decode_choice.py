"""The Gluon decode kernel is a speed choice of the chunks-in-parallel attention launch: without
an sm_90 GPU (here: CPU tensors) ``gluon=None`` never picks it and ``gluon=True`` raises, saying
why; the GPU checks of its bits are ``tests/gpu/test_gluon_attention_decode.py``.  The Gluon
kernels run only with the Triton release whose Gluon they are written for (its API moves between
releases); any other runs the Triton kernels, with the same bits."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _case():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 1, 128, generator=gen).half()
    k, v = (torch.randn(1, 2, 600, 128, generator=gen).half() for _ in range(2))
    return q, k, v, torch.tensor([[599]])


def test_gluon_decode_is_never_picked_off_the_gpu():
    from tpinv.kernels import triton_attention as ta
    from tpinv.kernels import triton_attention_split as sp
    q, k, v, pos = _case()
    a = sp.SplitLaunch(q, k, v, pos, *ta.mask_args(None, q), 4, True, None, 0.1, False,
                       ta.forward_config(q.dtype, 128), 128, 64, ta.KV_CHUNK_BLOCKS)
    assert sp.decode_kernel_for(a) is None
    assert sp.decode_kernel_for(a, False) is None
    with pytest.raises(ValueError, match="gluon=True: the Gluon decode kernel needs"):
        sp.decode_kernel_for(a, True)


def test_gluon_true_raises_off_the_gpu_and_without_split():
    from tpinv.kernels.triton_attention import attention_forward_cuda
    q, k, v, pos = _case()
    with pytest.raises(ValueError, match="gluon=True: the Gluon decode kernel needs"):
        attention_forward_cuda(q, k, v, pos, None, True, None, None, gluon=True)
    with pytest.raises(ValueError, match="needs split"):
        attention_forward_cuda(q, k, v, pos, None, True, None, None, split=False, gluon=True)
    with pytest.raises(ValueError, match="needs split"):
        attention_forward_cuda(q, k, v, pos, None, True, None, None, tma=True, gluon=True)


def test_gluon_kernels_need_the_triton_release_they_are_written_for():
    from tpinv.kernels.device import GLUON_TRITON, gluon_version_reason
    assert GLUON_TRITON == ((3, 6),)
    assert gluon_version_reason("3.6.0") is None
    assert gluon_version_reason("3.6.1+git1234") is None
    for other in ("3.5.1", "3.7.0", "3.9.0", "4.0.0"):  # control: every other release refused
        assert f"not of Triton {other}" in gluon_version_reason(other)
    assert "cannot read" in gluon_version_reason("nightly")
    import triton
    assert gluon_version_reason() == gluon_version_reason(triton.__version__)  # looked at once


def test_gluon_kernels_need_a_hopper_gpu():
    from tpinv.kernels.device import gluon_device_reason
    assert gluon_device_reason(torch.device("cpu")) == "needs a CUDA device, got cpu"
