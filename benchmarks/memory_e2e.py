"""Peak memory beside time, end to end: tpinv, the vanilla path and HF transformers on the same shapes.

Each case runs one model shape at ``batch x seq`` tokens through each path and records the
median seconds of a call and its peak memory above what was allocated before it (the
weights, and nothing else: gradients are dropped between runs) --
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.  The paths:

* ``tpinv``: :class:`tpinv.models.Transformer` (``loss`` / ``log_probs`` as the trainer and the
  RL scorers call them; ``tpinv-chunked``: with ``chunk_tokens``, the output layer and the
  cross-entropy a chunk of tokens at a time -- the same bits; ``tpinv-chunked-recompute``: also
  Megatron's full recompute, uniform, one layer per checkpoint -- the same bits);
* ``vanilla``: :mod:`tpinv.models.vanilla` on the same weights (cuBLAS, SDPA, full logits);
* ``hf``: ``transformers``' ``*ForCausalLM`` of the same shape with random weights (``labels=``
  for the loss; ``log_softmax`` of the logits for log-probs).

Measures: ``forward`` (no grad: the logits of every position), ``train`` (loss, backward) and
``logprob`` (no grad: per-token log-probs of the targets).  A path that runs out of memory
is recorded as ``"OOM"``; one that fails otherwise records its error.  On CPU only the time
is measured (peak memory is ``None``): a check of the script.
"""
from __future__ import annotations

import gc
import time
from typing import Callable, Optional

import torch

from benchmarks.common import synchronize
from tpinv.io.hf_keys import hf_config_from_args
from tpinv.models import Transformer, get_config
from tpinv.models.vanilla import vanilla_forward, vanilla_loss
from tpinv.testing.hf import TRANSFORMERS_MAJOR

__all__ = ["ISSUE_CASES", "TINY_CASES", "run_cases"]

GIB = 2 ** 30
#: (model[:layers], batch, seq, measures): the shapes of the memory comparison on one H100.
ISSUE_CASES = [
    ("qwen3-0.6b", 4, 1024, ("forward", "train")),
    ("qwen3-0.6b", 4, 4096, ("forward", "train")),
    ("llama3.2-1b:8", 4, 4096, ("forward", "train")),
    ("qwen3-0.6b", 1, 32768, ("logprob",)),      # one 32k-token rollout, 151,936-entry vocabulary
]
#: A CPU check of the script: every path and measure at a tiny shape.
TINY_CASES = [("qwen3-tiny", 2, 16, ("forward", "train", "logprob")),
              ("llama-tiny:1", 2, 16, ("forward", "train"))]


def _model_name(spec: str) -> tuple[str, Optional[int]]:
    name, _, layers = spec.partition(":")
    return name, int(layers) if layers else None


def build_tpinv(spec: str, dtype: torch.dtype, device) -> Transformer:
    name, layers = _model_name(spec)
    overrides = {"dtype": dtype} if layers is None else {"dtype": dtype, "num_layers": layers}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Transformer(get_config(name, **overrides)).to(device)


def build_hf(args, device):
    """``*ForCausalLM`` of ``args``' shape, random weights, in ``args.dtype``."""
    import transformers
    cfg = hf_config_from_args(args)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dtype_key = "dtype" if TRANSFORMERS_MAJOR >= 5 else "torch_dtype"
        model = transformers.AutoModelForCausalLM.from_config(config, **{dtype_key: args.dtype})
    return model.to(device)


def measure(fn: Callable[[], object], device, iters: int) -> dict:
    """Peak memory (GiB above what is allocated before the call) of one call, then the median
    seconds of ``iters`` calls."""
    gc.collect()
    peak = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / GIB
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"peak_gib_above_weights": peak, "s": sorted(times)[len(times) // 2]}


def _paths(measure_name: str, model: Transformer, hf, tokens, targets, weights, chunk: int) -> dict:
    """Callables of one measure, by path name."""
    def train(loss_fn, params, seed=weights, after=None):
        def run():
            for p in params:
                p.grad = None
            loss_fn().backward(seed)
            for p in params:
                p.grad = None
            if after is not None:
                after()
        return run

    def recomputed(m):  # Megatron's full recompute, one layer per checkpoint (the same bits)
        return m.set_recompute("full", "uniform", 1)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    def hf_log_probs():
        logits = hf(input_ids=tokens).logits
        return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]

    def vanilla_log_probs():
        logits = vanilla_forward(model, tokens, gather_logits=True).float()
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]

    params = list(model.parameters())
    paths = {}
    if measure_name == "forward":
        paths = {"tpinv": no_grad(lambda: model(tokens)), "vanilla": no_grad(lambda: vanilla_forward(model, tokens)),
                 "hf": no_grad(lambda: hf(input_ids=tokens).logits)}
    elif measure_name == "train":
        hf_params = list(hf.parameters())
        paths = {"tpinv": train(lambda: model.loss(tokens, targets), params),
                 "tpinv-chunked": train(lambda: model.loss(tokens, targets, chunk_tokens=chunk), params),
                 "tpinv-chunked-recompute": train(lambda: recomputed(model).loss(tokens, targets, chunk_tokens=chunk),
                                                  params, after=lambda: model.set_recompute()),
                 "vanilla": train(lambda: vanilla_loss(model, tokens, targets), params),
                 "hf": train(lambda: hf(input_ids=tokens, labels=tokens).loss, hf_params, None)}
    elif measure_name == "logprob":
        paths = {"tpinv-chunked": no_grad(lambda: model.log_probs(tokens, targets, chunk_tokens=chunk)),
                 "vanilla": no_grad(vanilla_log_probs), "hf": no_grad(hf_log_probs)}
    return paths


def run_case(spec: str, batch: int, seq: int, measures, *, dtype, device, iters: int, chunk: int) -> dict:
    model = build_tpinv(spec, dtype, device)
    hf = build_hf(model.args, device)
    gen = torch.Generator().manual_seed(11)
    vocab = model.args.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    weights = (torch.rand(batch, seq, generator=gen) / (batch * seq)).to(device)
    out = {"model": spec, "batch": batch, "seq": seq, "vocab": vocab, "chunk_tokens": chunk,
           "note": "peak_gib_above_weights: max_memory_allocated during one call minus memory_allocated "
                   "before it (weights and inputs); a train step's includes the parameter gradients",
           "weights_gib": sum(p.numel() * p.element_size() for p in model.parameters()) / GIB}
    for measure_name in measures:
        for path, fn in _paths(measure_name, model, hf, tokens, targets, weights, chunk).items():
            try:
                out[f"{measure_name}/{path}"] = measure(fn, device, iters)
            except torch.cuda.OutOfMemoryError:
                out[f"{measure_name}/{path}"] = "OOM"
            except Exception as exc:  # recorded; the other paths still run
                out[f"{measure_name}/{path}"] = f"{type(exc).__name__}: {exc}"[:500]
            for p in list(model.parameters()) + list(hf.parameters()):
                p.grad = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    del model, hf
    gc.collect()
    return out


def run_cases(cases, *, dtype, device, iters: int, chunk: int) -> list[dict]:
    return [run_case(spec, b, s, m, dtype=dtype, device=device, iters=iters, chunk=chunk) for spec, b, s, m in cases]


def format_rows(records: list[dict]) -> list[str]:
    lines = [f"{'case':<34} {'measure/path':<24} {'peak GiB':>9} {'seconds':>9}"]
    for r in records:
        case = f"{r['model']} {r['batch']}x{r['seq']}"
        for key, value in r.items():
            if "/" not in key:
                continue
            if isinstance(value, dict):
                peak = value["peak_gib_above_weights"]
                lines.append(f"{case:<34} {key:<24} {'-' if peak is None else f'{peak:.2f}':>9} {value['s']:>9.4f}")
            else:
                lines.append(f"{case:<34} {key:<24} {str(value)[:60]}")
    return lines
