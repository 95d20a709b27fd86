"""Every tpinv op has a CUDA kernel that keeps the contract's order -- never a cuBLAS/aten fallback.

Each op's definition (``tpinv.ops.registry.OPS``) names its CUDA kernel: a Triton function of
``tpinv.kernels`` resolved on first use, the reference kernel's own fixed-order torch code
(``REFERENCE``), or (matmul, tree_sum) a small adapter in the op's module; a slot nobody filled
raises.
"""
import importlib

import pytest
import torch

import tpinv.ops  # noqa: F401  (imports every op module, which defines its ops)
from tpinv.ops.linear import _matmul_cuda, _tree_sum_cuda, matmul_op
from tpinv.ops.registry import (OPS, REFERENCE, cuda_kernel, define_op, has_cuda_kernel, missing_cuda_kernel,
                                register_fake)

EXPECTED = {  # every op of the library, so a new op must be listed (and its slot decided) here
    "attention", "attention_backward", "embedding", "embedding_backward", "log_softmax", "log_softmax_backward",
    "logsumexp", "logsumexp_backward", "matmul", "matmul_partial", "rms_norm", "rms_norm_backward",
    "rms_norm_backward_heads", "silu_mul", "silu_mul_backward", "apply_rope", "apply_rope_backward", "softmax",
    "softmax_backward", "sum_exp_partial", "tree_sum", "rope_cos_sin", "sum_exp_partial_backward",
    "cross_entropy_lse", "cross_entropy_grad",
}
LIBRARY = {q: d for q, d in OPS.items() if q.removeprefix("tpinv::") in EXPECTED}


def test_every_op_is_defined_once_with_a_check():
    assert set(q.removeprefix("tpinv::") for q in LIBRARY) == EXPECTED
    assert all(d.check is not None for d in LIBRARY.values())


@pytest.mark.parametrize("qualname", sorted(LIBRARY))
def test_every_slot_holds_its_named_kernel(qualname):
    d = LIBRARY[qualname]
    assert has_cuda_kernel(d.op)
    kernel = cuda_kernel(d.op)
    if d.cuda == REFERENCE:
        # the very function the CPU slot runs (each slot makes its kernel's outputs contiguous)
        assert kernel is d.reference is d.op._init_fn.__wrapped__
    elif isinstance(d.cuda, str):  # a Triton function, imported on first use (tests/gpu runs them)
        assert kernel.__name__ == d.cuda
        assert callable(getattr(importlib.import_module(kernel.triton_module), kernel.triton_name))
    else:   # an adapter beside the op
        assert (qualname, kernel) in {("tpinv::matmul", _matmul_cuda), ("tpinv::tree_sum", _tree_sum_cuda)}


def test_matmul_adapter_names_the_triton_contract_kernel():
    from tpinv.ops.linear import _matmul_kernel
    assert cuda_kernel(matmul_op) is _matmul_cuda and _matmul_kernel.__name__ == "matmul_route.matmul_cuda"
    assert callable(getattr(importlib.import_module(_matmul_kernel.triton_module), _matmul_kernel.triton_name))


def test_tree_sum_adapter_names_the_halving_kernel():
    from tpinv.ops.linear import _halving_sum_kernel
    assert _halving_sum_kernel.__name__ == "triton_tree.halving_sum_cuda"
    assert callable(getattr(importlib.import_module(_halving_sum_kernel.triton_module),
                            _halving_sum_kernel.triton_name))


def test_an_unfilled_slot_raises_instead_of_falling_back():
    placeholder = missing_cuda_kernel("tpinv::example")
    with pytest.raises(NotImplementedError, match="tpinv::example has no CUDA kernel yet"):
        placeholder(torch.zeros(1))

    @define_op("cuda_slot_probe", cuda=None)
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    assert not has_cuda_kernel(probe)
    with pytest.raises(NotImplementedError, match="tpinv::cuda_slot_probe has no CUDA kernel yet"):
        cuda_kernel(probe)(torch.zeros(1))
    with pytest.raises(ValueError, match="defined twice"):
        define_op("cuda_slot_probe", cuda=None)(lambda x: x)


def test_the_check_runs_once_per_call():
    """Checks are counted: the public wrapper adds none; the fake runs the op's check once."""
    calls = []

    def check(x: torch.Tensor) -> None:
        calls.append(1)
        if x.dim() != 1:
            raise ValueError("probe wants a vector")

    @define_op("check_count_probe", cuda=None, check=check)
    def probe(x: torch.Tensor) -> torch.Tensor:
        check(x)  # a reference kernel checks at its entry
        return x * 2

    @register_fake(probe)
    def _fake(x):
        return torch.empty_like(x)

    probe(torch.ones(3))
    assert len(calls) == 1
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        probe(mode.from_tensor(torch.ones(3)))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="probe wants a vector"):
        probe(torch.ones(2, 2))


@pytest.mark.parametrize("family,check,call", [
    ("reference_norm", "check_rms_norm_inputs",
     lambda ops: ops.rms_norm(torch.randn(3, 16), torch.ones(16))),
    ("reference_softmax", "check_softmax_inputs", lambda ops: ops.log_softmax(torch.randn(3, 16), 8)),
    ("reference_activation", "check_silu_mul_inputs",
     lambda ops: ops.silu_mul(torch.randn(3, 16), torch.randn(3, 16))),
    ("reference_matmul", "check_matmul_inputs", lambda ops: ops.matmul_partial(torch.randn(3, 16), torch.randn(4, 16))),
    ("reference_rope", "check_rope_inputs",
     lambda ops: ops.apply_rope(torch.randn(1, 2, 3, 8), torch.ones(3, 8), torch.zeros(3, 8))),
])
def test_a_library_op_checks_its_inputs_once_per_call(monkeypatch, family, check, call):
    """The public wrapper, the op and the reference kernel share one check, run once."""
    module = importlib.import_module(f"tpinv.kernels.{family}")
    real, calls = getattr(module, check), []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, check, counted)
    call(tpinv.ops)
    assert len(calls) == 1, (family, len(calls))
