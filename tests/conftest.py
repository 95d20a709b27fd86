"""Shared pytest configuration: GPU tests skip without CUDA."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run through the device tool)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/") or item.get_closest_marker("gpu"):
            item.add_marker(skip)
