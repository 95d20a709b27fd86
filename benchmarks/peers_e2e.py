"""The peer a user already has, timed beside tpinv in the same run: Hugging Face transformers.

``*ForCausalLM`` of the tpinv model's shape (:func:`benchmarks.memory_e2e.build_hf`, random
weights, SDPA attention), on the workloads of :mod:`benchmarks.bench_e2e`:

* training step: ``logits = model(tokens).logits``, the same per-token weighted cross-entropy
  as tpinv's ``loss(...).backward(weights)``, backward; eager;
* greedy decoding of ``new`` tokens for each of ``batch`` sequences after a prompt, through
  ``generate`` (``do_sample=False``, exactly ``new`` tokens): with the dynamic cache (eager) and
  with the static cache, which transformers compiles for decoding on CUDA
  (``cache_implementation="static"``).  tokens/s counts the decode steps only: the time of
  ``new`` tokens minus the time of one token (the prefill and its first token), over ``new - 1``.

When the public ``batch_invariant_ops`` package (Thinking Machines Lab's batch-invariant
kernels: ``aten::mm``, ``addmm``, ``_log_softmax`` and ``mean.dim`` replaced by Triton kernels
through ``torch.library``) can be imported, the HF training step and eager decoding are timed
again inside its ``set_batch_invariant_mode(True)``: the recipe a user would otherwise apply to
HF for batch invariance (not TP invariance).  It is not a dependency of tpinv: put its source on
``PYTHONPATH`` (or install it) to include it.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F

from benchmarks.common import host_median_s, synchronize
from benchmarks.memory_e2e import build_hf

__all__ = ["hf_available", "hf_times", "batch_invariant_mode"]


def hf_available() -> Optional[str]:
    """None when transformers can be imported, else why not."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"transformers is not installed ({exc})"
    return None


def batch_invariant_mode():
    """``batch_invariant_ops.set_batch_invariant_mode`` when the package can be imported, else None."""
    try:
        from batch_invariant_ops import set_batch_invariant_mode
    except ImportError:
        return None
    return set_batch_invariant_mode


def hf_train_seconds(hf, tokens: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, device,
                     iters: int) -> float:
    def run():
        hf.zero_grad(set_to_none=True)
        logits = hf(input_ids=tokens, use_cache=False).logits
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        (nll * weights.flatten()).sum().backward()
    seconds = host_median_s(run, iters, sync=lambda: synchronize(device))
    hf.zero_grad(set_to_none=True)
    return seconds


def hf_decode_tokens_per_s(hf, prompt: torch.Tensor, new: int, device, repeats: int, static: bool) -> float:
    """Decode steps per second times the batch (``generate``'s time for ``new`` tokens minus one)."""
    extra = {"cache_implementation": "static"} if static else {}

    def generate(n: int) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0, **extra)
        synchronize(device)
        return time.perf_counter() - t0

    generate(new)                                    # warm-up (compiles the static-cache step)
    generate(new)
    steps = sorted(generate(new) - generate(1) for _ in range(repeats))
    return prompt.shape[0] * (new - 1) / steps[len(steps) // 2]


def hf_times(model, device, *, batch: int, seq: int, iters: int, decode_batch: int, prompt_len: int,
             new: int, repeats: int) -> dict:
    """The HF peer's training step seconds and decode rates for ``model``'s shape (the inputs
    drawn as :mod:`benchmarks.bench_e2e` draws them)."""
    hf = build_hf(model.args, device)
    hf.config.use_cache = True
    gen = torch.Generator().manual_seed(11)
    vocab = model.args.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    weights = (torch.rand(batch, seq, generator=gen) / (batch * seq)).to(device)
    out = {"hf_attn_implementation": hf.config._attn_implementation,
           "hf_s": hf_train_seconds(hf, tokens, targets, weights, device, iters)}
    prompt = torch.randint(0, vocab, (decode_batch, prompt_len), generator=torch.Generator().manual_seed(7))
    prompt = prompt.to(device)
    mode = batch_invariant_mode() if device.type == "cuda" else None
    if mode is not None:
        with mode(True):
            out["hf_bio_s"] = hf_train_seconds(hf, tokens, targets, weights, device, iters)
            with torch.no_grad():
                out["hf_bio_eager_tokens_per_s"] = hf_decode_tokens_per_s(hf, prompt, new, device, repeats,
                                                                          static=False)
    with torch.no_grad():
        out["hf_eager_tokens_per_s"] = hf_decode_tokens_per_s(hf, prompt, new, device, repeats, static=False)
        if device.type == "cuda":
            try:
                out["hf_static_compiled_tokens_per_s"] = hf_decode_tokens_per_s(hf, prompt, new, device, repeats,
                                                                                static=True)
            except Exception as exc:  # reported in the table and the JSON, the rest still stands
                out["hf_static_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def print_peers(peers: dict, train: dict, decode: dict, batch: int) -> None:
    """tpinv's best and eager numbers against HF transformers' (its attention named)."""
    print(f"{'against HF transformers (' + peers['hf_attn_implementation'] + ')':<40} {'tpinv':>12} {'HF':>12} "
          f"{'tpinv/HF':>9}")
    rows = [("train step s, eager", train["invariant_s"], peers["hf_s"])]
    if "invariant_graph_s" in train:
        rows.append(("train step s, tpinv graph vs HF eager", train["invariant_graph_s"], peers["hf_s"]))
    rows.append((f"decode tok/s (batch {batch}), eager", decode["invariant_eager_tokens_per_s"],
                 peers["hf_eager_tokens_per_s"]))
    if "hf_static_compiled_tokens_per_s" in peers and "invariant_graph_tokens_per_s" in decode:
        rows.append(("decode tok/s, tpinv graph vs HF static+compiled", decode["invariant_graph_tokens_per_s"],
                     peers["hf_static_compiled_tokens_per_s"]))
    if "hf_bio_s" in peers:
        rows.append(("train step s, eager vs HF + batch_invariant_ops", train["invariant_s"], peers["hf_bio_s"]))
        rows.append(("decode tok/s, eager vs HF + batch_invariant_ops", decode["invariant_eager_tokens_per_s"],
                     peers["hf_bio_eager_tokens_per_s"]))
    for label, ours, theirs in rows:
        print(f"{label:<40} {ours:>12.4g} {theirs:>12.4g} {ours / theirs:>9.2f}")
    if "hf_static_error" in peers:
        print(f"HF static-cache decoding failed: {peers['hf_static_error'][:300]}")
