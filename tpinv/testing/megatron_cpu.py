"""Run megatron-core on CPU (gloo) for tests: the recipe, applied to the calling process only.

megatron-core assumes CUDA in a few places a CPU test reaches.  :func:`megatron_cpu_shims`
replaces, in this process only:

* the CUDA RNG tracker (``get_cuda_rng_tracker``): ``fork()`` becomes a no-op context -- with
  tpinv's invariant dropout no random generator is drawn from inside it;
* without CUDA, the CUDA generator's state in megatron's activation recompute
  (``tensor_parallel.checkpoint`` saves and restores it around the recomputed forward): reading it
  gives ``None`` and restoring ``None`` does nothing -- the CPU generator's state is still saved
  and restored by megatron itself;
* ``torch.cuda.current_device`` -> ``"cpu"`` (megatron allocates its DDP buffers and scalars there),
  and, without CUDA, ``torch.cuda.synchronize`` -> no-op and ``Tensor.cuda()`` -> the tensor itself
  (megatron's pipeline schedules call both);
* ``device="cuda"`` in the tensor factories (``torch.tensor/zeros/ones/empty/full``) of megatron's
  optimizer and DDP modules -> CPU, through a ``torch`` stand-in bound in those modules only;
* the ``torch.cuda.FloatTensor`` type assertion of megatron's gradient clipping
  (``clip_grad_by_total_norm_fp32``): the same elementwise scaling without the assertion;
* the parameter-type checks in the constructors of megatron's bf16/fp16 optimizer
  (``Float16OptimizerWithFloat16Params``: ``param.type() in ['torch.cuda.HalfTensor',
  'torch.cuda.BFloat16Tensor']``, else ``== 'torch.cuda.FloatTensor'``, else ``TypeError``) and of
  its distributed optimizer (``DistributedOptimizer.__init__`` and its
  ``_build_model_and_main_param_groups``, the same checks): while those constructors run,
  ``Tensor.type()`` names a CPU float tensor by its CUDA type (``torch.BFloat16Tensor`` ->
  ``torch.cuda.BFloat16Tensor``); nothing else about the tensors changes;
* without Transformer Engine, the distributed optimizer's ``quantize_param_shard`` (fp8 parameters)
  given no fp8 parameters returns, as megatron-core 0.16's own fallback does (0.12's raises "Invalid
  Transformer Engine version" even then).

tpinv itself never patches megatron; only tests and CPU experiments call this.
"""
from __future__ import annotations

import contextlib

import torch


class _CPUTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()

    def add(self, *args, **kwargs):
        pass

    def reset(self):
        pass

    def get_states(self):
        return {}

    def set_states(self, states):
        pass

    def is_initialized(self):
        return True


def _clip_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        with torch.no_grad():
            for p in parameters:
                g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
                if g is not None:
                    g.mul_(coeff)


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


class _CPUTorch:
    """``torch`` for one megatron module, its factories' ``device="cuda"`` sent to the CPU."""

    def __init__(self):
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn):
        def make(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and "cuda" in str(device):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)
        return make

    def __getattr__(self, name):
        return getattr(torch, name)


_CUDA_MODULES = ("megatron.core.utils", "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads", "megatron.core.optimizer.distrib_optimizer",
                 "megatron.core.distributed.param_and_grad_buffer",
                 "megatron.core.distributed.distributed_data_parallel", "megatron.core.pipeline_parallel.schedules",
                 "megatron.core.pipeline_parallel.p2p_communication")


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _reading_cpu_types_as_cuda(init):
    """``init`` with ``Tensor.type()`` naming a CPU float tensor by its CUDA type while it runs."""
    def wrapped(*args, **kwargs):
        real = torch.Tensor.type

        def cuda_named(self, *a, **k):
            name = real(self, *a, **k)
            return _CUDA_TYPE_NAMES.get(name, name) if not a and not k else name
        torch.Tensor.type = cuda_named
        try:
            return init(*args, **kwargs)
        finally:
            torch.Tensor.type = real
    wrapped._tpinv_cpu = True
    return wrapped


def _skipping_no_fp8(quantize):
    def wrapped(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return quantize(model_params, *args, **kwargs)
    wrapped._tpinv_cpu = True
    return wrapped


def megatron_cpu_shims() -> None:
    """Apply the CPU replacements listed in the module docstring (idempotent)."""
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.tensor_parallel.random as mrandom

    tracker = _CPUTracker()
    tensor_parallel.get_cuda_rng_tracker = mrandom.get_cuda_rng_tracker = lambda *a, **k: tracker
    for mod in ("megatron.core.transformer.attention", "megatron.core.transformer.dot_product_attention",
                "megatron.core.models.common.embeddings.language_model_embedding"):
        try:
            m = __import__(mod, fromlist=["_"])
        except ImportError:
            continue
        if hasattr(m, "get_cuda_rng_tracker"):
            m.get_cuda_rng_tracker = mrandom.get_cuda_rng_tracker
    if not torch.cuda.is_available():  # recompute: megatron saves/restores the CUDA generator too
        mrandom._get_cuda_rng_state = lambda *a, **k: None
        mrandom._set_cuda_rng_state = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    if not torch.cuda.is_available():  # the pipeline schedules synchronize and call Tensor.cuda()
        torch.cuda.synchronize = lambda *a, **k: None
        torch.Tensor.cuda = lambda self, *a, **k: self
    for mod in _CUDA_MODULES:
        try:
            m = __import__(mod, fromlist=["_"])
        except ImportError:  # pragma: no cover - depends on the version
            continue
        if not isinstance(m.torch, _CPUTorch):
            m.torch = _CPUTorch()
    try:
        import megatron.core.optimizer.clip_grads as clip_grads
        import megatron.core.optimizer.optimizer as optimizer
    except ImportError:  # pragma: no cover - depends on the version
        return
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = _clip_cpu
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        if not getattr(cls.__init__, "_tpinv_cpu", False):
            cls.__init__ = _reading_cpu_types_as_cuda(cls.__init__)
    quantize = getattr(distrib_optimizer, "quantize_param_shard", None)
    if quantize is not None and not getattr(quantize, "_tpinv_cpu", False):
        distrib_optimizer.quantize_param_shard = _skipping_no_fp8(quantize)
