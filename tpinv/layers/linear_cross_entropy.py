"""The output layer and its cross-entropy in token chunks: the bits of the unchunked path, bounded memory.

``linear_cross_entropy(hidden, weight, target)`` is, bit for bit in the loss and in both
gradients, ``vocab_parallel_cross_entropy(ColumnParallelLinear(hidden), target)`` -- without ever
holding the ``[tokens, V/C]`` logits.  Why the chunking cannot change a bit:

* the forward and ``dX`` are per token: a logit depends on its own hidden row and weight row
  (:mod:`tpinv.kernels.reference_matmul`), the max, the contract's sum of exponentials and the
  target pick are per row, and the column layer's ``dX`` row ``t`` depends on row ``t`` of
  ``dY`` only.  So both run on ``chunk_tokens`` tokens at a time, the logits recomputed in the
  backward from the saved hidden states;
* ``dW = dY^T X`` reduces over the tokens, in one fixed chain over all of them.  Instead of
  cutting that reduction, the backward cuts the other dimension: ``dW``'s rows for a slice of
  the vocabulary need ``dY`` for that slice only, over every token -- the unchunked reduction
  itself, on a ``[tokens, slice]`` block whose logits are recomputed (each logit has the bits
  of the full matrix's).  The slice holds about as many elements as a token chunk.

Memory: at most ``chunk_tokens * V/C`` logits live at once (at the backward's peak, with 16-bit
logits, 4 bytes each on CUDA -- the rounded logits and their rounded gradient, computed in fp32
in one pass -- and 8 on the CPU, whose kernel keeps an fp32 buffer of the gradient), besides the saved hidden states and one fp32 value per token.  The cost: none in a forward
without grad; with a backward the output layer's product runs twice more (the logits are
recomputed for ``dX`` and for ``dW``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tpinv.core.autograd import apply_function
from tpinv.core.contract import DEFAULT_LEAVES
from tpinv.distributed.groups import group_size_rank
from tpinv.layers.cross_entropy import logits_grad, logsumexp_and_target
from tpinv.layers.functions import column_input_grad, rounded_matmul, weight_grad

__all__ = ["linear_cross_entropy", "linear_log_probs", "check_chunk_tokens", "LOG_PROB_CHUNK_TOKENS"]

#: Tokens per chunk of the RL log-prob paths (:mod:`tpinv.rl`, :func:`tpinv.engine.metrics.trainer_log_probs`):
#: 512 x 151,936 vocabulary entries are 0.29 GiB of fp32 logits at TP=1 (V/C entries per rank).
LOG_PROB_CHUNK_TOKENS = 512


def check_chunk_tokens(chunk_tokens: Optional[int], name: str = "chunk_tokens") -> Optional[int]:
    """``None`` (no chunking) or a positive token count; anything else is refused by name."""
    if chunk_tokens is None:
        return None
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"{name}={chunk_tokens!r}: expected a positive number of tokens (or None: unchunked)")
    return chunk_tokens


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, group, leaves, chunk):
        x = hidden.reshape(-1, hidden.shape[-1])
        t = target.reshape(-1)
        loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        lse = torch.empty_like(loss)
        for s in range(0, x.shape[0], chunk):
            logits = rounded_matmul(x[s:s + chunk], weight, 1)
            row_lse, picked = logsumexp_and_target(logits, t[s:s + chunk], group, leaves)[1:3]
            lse[s:s + chunk] = row_lse
            loss[s:s + chunk] = row_lse - picked
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.group, ctx.leaves, ctx.chunk = group, leaves, chunk
        return loss.reshape(target.shape)

    @staticmethod
    def backward(ctx, dloss):
        hidden, weight, target, lse = ctx.saved_tensors
        group, leaves, chunk = ctx.group, ctx.leaves, ctx.chunk
        x = hidden.reshape(-1, hidden.shape[-1])
        local = target.reshape(-1) - group_size_rank(group)[1] * weight.shape[0]
        dloss = dloss.reshape(-1)
        tokens, vocab = x.shape[0], weight.shape[0]
        dx = dw = None
        if ctx.needs_input_grad[0]:   # per token: chunks of rows
            dx = torch.empty_like(x)
            for s in range(0, tokens, chunk):
                rows = slice(s, s + chunk)
                logits = rounded_matmul(x[rows], weight, 1)
                dy = logits_grad(logits, lse[rows], local[rows], dloss[rows])
                dx[rows] = column_input_grad(dy, weight, group, leaves)
            dx = dx.reshape(hidden.shape)
        if ctx.needs_input_grad[1]:   # per vocabulary row: slices of the vocabulary, every token
            width = max(1, min(vocab, chunk * vocab // max(tokens, 1)))
            dw = torch.empty_like(weight)
            for v in range(0, vocab, width):
                cols = slice(v, v + width)
                logits = rounded_matmul(x, weight[cols], 1)
                dy = logits_grad(logits, lse, local - v, dloss)
                dw[cols] = weight_grad(dy, x, weight.dtype)
        return dx, dw, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         tp_group: Optional[dist.ProcessGroup] = None, leaves: int = DEFAULT_LEAVES,
                         chunk_tokens: int = 4096) -> torch.Tensor:
    """Per-token loss (fp32, shaped like ``target``) of ``hidden [..., H]`` through this rank's
    output-layer shard ``weight [V/C, H]``, computed ``chunk_tokens`` tokens at a time.

    The same bits, loss and gradients, as the column-parallel layer's logits (no bias) fed to
    :func:`tpinv.layers.vocab_parallel_cross_entropy`, at every chunk size and TP size.
    """
    check_chunk_tokens(chunk_tokens)
    if chunk_tokens is None:
        raise ValueError("chunk_tokens=None: call vocab_parallel_cross_entropy on the logits instead")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"target has shape {tuple(target.shape)}, expected {tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V/C, {hidden.shape[-1]}], got {list(weight.shape)}")
    return apply_function(_LinearCrossEntropy, hidden, weight, target.long(), tp_group, leaves, chunk_tokens)


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                     tp_group: Optional[dist.ProcessGroup] = None, leaves: int = DEFAULT_LEAVES,
                     chunk_tokens: int = 4096) -> torch.Tensor:
    """Per-token ``log p(target)`` (fp32): ``-linear_cross_entropy``, the same bits."""
    return -linear_cross_entropy(hidden, weight, target, tp_group=tp_group, leaves=leaves,
                                 chunk_tokens=chunk_tokens)
