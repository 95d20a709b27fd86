"""The shared decisions each live in one place: process-group ``None``, dtype names, model sources."""
import pytest
import torch
import torch.distributed as dist

from tpinv.core.contract import InvarianceError
from tpinv.core.dtypes import CLI_CHOICES, MODEL_DTYPES, NAMES, SAFETENSORS_CODES, cli_dtype, dtype_from_name, dtype_name
from tpinv.distributed.groups import group_size, group_size_rank, resolve_group


def test_none_is_a_single_rank_without_torch_distributed():
    assert not dist.is_initialized()
    assert group_size_rank(None) == (1, 0) and group_size(None) == 1 and resolve_group(None) is None


def test_none_among_several_ranks_raises(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    for fn in (group_size_rank, group_size, resolve_group):
        with pytest.raises(InvarianceError, match="dp_group=None while torch.distributed is initialized with 4 ranks"):
            fn(None, "dp_group")


def test_none_in_a_world_of_one_is_a_single_rank(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert group_size_rank(None) == (1, 0)


def test_every_layer_uses_the_one_rule(monkeypatch):
    """A layer, a region and the reducer refuse ``None`` among several ranks alike."""
    from tpinv.distributed.mappings import scatter_to_tensor_model_parallel_region
    from tpinv.distributed.reduce import tree_all_reduce
    from tpinv.layers.cross_entropy import vocab_parallel_cross_entropy
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    calls = (lambda: tree_all_reduce(torch.ones(4), None),
             lambda: scatter_to_tensor_model_parallel_region(torch.ones(2, 4), None),
             lambda: vocab_parallel_cross_entropy(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), tp_group=None))
    for call in calls:
        with pytest.raises(InvarianceError, match="=None while torch.distributed is initialized with 2 ranks"):
            call()


def test_dtype_names_round_trip_and_short_forms_are_read_only():
    for name, dtype in NAMES.items():
        assert dtype_name(dtype) == name and dtype_from_name(name) is dtype
    for short, full in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")):
        assert dtype_from_name(short) is NAMES[full]
    assert set(SAFETENSORS_CODES) <= set(NAMES.values())
    assert [cli_dtype(c) for c in CLI_CHOICES] == [None, torch.bfloat16, torch.float16, torch.float32]
    with pytest.raises(ValueError, match="dtype 'float8' is not supported"):
        dtype_from_name("float8")
    with pytest.raises(NotImplementedError, match="config dtype 'int8' is not supported"):
        dtype_from_name("int8", allowed=MODEL_DTYPES, error=NotImplementedError, what="config dtype")


def test_model_sources_are_detected_once(tmp_path):
    from tpinv.io.loading import source_model_args
    args, kind = source_model_args("qwen3-tiny", torch.bfloat16)
    assert kind == "config" and args.dtype is torch.bfloat16
    with pytest.raises(FileNotFoundError, match="holds neither"):
        source_model_args(str(tmp_path))
    with pytest.raises(ValueError, match="neither a directory nor a named config"):
        source_model_args("no-such-model")
