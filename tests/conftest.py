"""Shared pytest configuration: GPU tests skip without CUDA; under a forced CPU kernel set the
plain ``torch.compile`` calls of the tests get the vector length ``tpinv.compile`` names."""
import pytest
import torch

from tpinv.core.compile import forced_simdlen


def pytest_configure(config):
    if forced_simdlen() is not None:
        import torch._inductor.config as inductor_config
        inductor_config.cpp.simdlen = forced_simdlen()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run through the device tool)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/") or item.get_closest_marker("gpu"):
            item.add_marker(skip)
