"""The vanilla control: the same model and weights, run the way Megatron/HF do it.

``vanilla_forward(model, ...)`` reads the parameters of a :class:`~tpinv.models.transformer.
Transformer` and computes the same function with plain PyTorch: ``F.linear`` (BLAS),
``F.scaled_dot_product_attention`` on CUDA and its split-KV order written out on CPU
(:func:`split_kv_attention`), ``F.silu``, ``torch.mean`` RMSNorm, and Megatron's
tensor parallelism (row-parallel partials rounded to the model dtype and added by
``dist.all_reduce``).  It keeps no invariant -- it exists to show, on the same inputs, that
the vanilla path changes bits with TP size, batch composition and prefill vs decode while
tpinv's does not.  Only the ``tree`` row layout is supported (Megatron's weight shards).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpinv.core.capture import capturing
from tpinv.distributed.groups import group_size, group_size_rank
from tpinv.models.kv_cache import KVCache
from tpinv.models.transformer import packed_key_positions, select_positions
from tpinv.ops import rope_cos_sin
from tpinv.ops.attention import block_visibility
from tpinv.ops.attention_packed import packed_visible


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if group_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        if group_size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(group_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank = group_size_rank(ctx.group)[1]
        return grad.narrow(-1, rank * ctx.n, ctx.n).contiguous(), None


class _VanillaCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy: plain sums and ``all_reduce``."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        x = logits.float()
        m = x.max(dim=-1).values
        if group_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m.unsqueeze(-1))
        s = e.sum(dim=-1)
        local = target - vocab_start
        outside = (local < 0) | (local >= x.shape[-1])
        local = local.masked_fill(outside, 0)
        picked = (x.gather(-1, local.unsqueeze(-1)).squeeze(-1) - m).masked_fill(outside, 0.0)
        if group_size(group) > 1:
            dist.all_reduce(s, group=group)
            dist.all_reduce(picked, group=group)
        ctx.save_for_backward(e / s.unsqueeze(-1), local, outside)
        ctx.dtype = logits.dtype
        return torch.log(s) - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        hit = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), (~outside).float().unsqueeze(-1))
        return ((softmax - hit) * grad.unsqueeze(-1)).to(ctx.dtype), None, None, None


def plain_rms_norm(x, weight, eps):
    """HF's RMSNorm: fp32 statistics with ATen's reductions, rounded, times the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def plain_rope(x, cos, sin):
    """HF's rotation in the input dtype: ``x * cos + rotate_half(x) * sin``."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _column(x, layer, group):
    return F.linear(_CopyToTP.apply(x, group), layer.weight, layer.bias)


def _row(x, layer, group):
    y = _ReduceFromTP.apply(F.linear(x, layer.weight), group)
    return y if layer.bias is None else y + layer.bias


def _fast_cuda_attention(q, k, v, positions, cached: bool, gqa: bool):
    """SDPA without a mask where none is needed (what a serving engine runs on a GPU), or None.

    A prefill from slot 0 takes the causal flash path; a decode step in which every
    request sits at the same position attends the used slots only (not inside a CUDA-graph
    capture: finding that out reads the positions on the host).  Same function as the
    masked call; the speed of the vanilla control on CUDA, its numerics unchanged in kind.
    """
    if not cached:  # without a cache the positions are arange(S): causal from slot 0
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if capturing():  # a captured step cannot read positions on the host: the masked call
        return None
    used = int(positions.max()) + 1 if positions.numel() else 0
    if q.shape[2] == 1 and bool((positions == used - 1).all()):
        return F.scaled_dot_product_attention(q, k[:, :, :used], v[:, :, :used], enable_gqa=gqa)
    return None


def split_kv_attention(q, k, v, visible):
    """Masked attention the way split-KV (flash-decoding) kernels order it, written out for CPU.

    The keys are cut into contiguous chunks whose size follows the call's shape -- pairs of
    keys for a decode step (one query), halves of the keys for a prefill -- and each chunk's
    ``p @ v`` partial is stored in the activation dtype before the partials are added in
    order.  So prefill vs decode, padding and batch composition change the order of the sums
    on every CPU kernel set (torch's CPU SDPA happens to keep its order on some sets, so it
    cannot serve as the control there).  ``q [B, Hq, S, D]``, ``k, v [B, Hkv, T, D]``,
    ``visible`` bool ``[B, 1, S, T]``.
    """
    S, D, T = q.shape[2], q.shape[3], k.shape[2]
    g = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = (q.float() @ kf.transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
    chunk = 2 if S == 1 else max(1, -(-T // 2))
    l = torch.zeros_like(s[..., :1])
    o = torch.zeros_like(q, dtype=torch.float32)
    for j0 in range(0, T, chunk):
        l = l + p[..., j0:j0 + chunk].sum(-1, keepdim=True)
        o = o + (p[..., j0:j0 + chunk] @ vf[:, :, j0:j0 + chunk]).to(q.dtype).float()
    return torch.where(l > 0, o / torch.where(l > 0, l, 1.0), 0.0).to(q.dtype)


def _attention(attn, x, cos, sin, positions, mask, cache, layer, group, k_pos=None):
    B, S, _ = x.shape
    q = _column(x, attn.q_proj, group).view(B, S, attn.local_heads, attn.head_dim)
    k = _column(x, attn.k_proj, group).view(B, S, attn.local_kv_heads, attn.head_dim)
    v = _column(x, attn.v_proj, group).view(B, S, attn.local_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q = plain_rms_norm(q, attn.q_norm.weight, attn.q_norm.eps)
        k = plain_rms_norm(k, attn.k_norm.weight, attn.k_norm.eps)
    q, k, v = plain_rope(q.transpose(1, 2), cos, sin), plain_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)
    gqa = attn.local_heads != attn.local_kv_heads
    if cache is not None:
        k, v = cache.append(layer, k, v, positions, check=False)  # checked once per step
    if q.is_cuda and mask is None and attn.window is None and k_pos is None:
        out = _fast_cuda_attention(q, k, v, positions, cache is not None, gqa)
        if out is not None:
            return _row(out.transpose(1, 2).reshape(B, S, -1), attn.o_proj, group)
    if k_pos is not None:  # a packed row: causality follows the keys' positions
        visible = torch.stack([packed_visible(positions[b], k_pos[b], None if mask is None else mask[b],
                                              True, attn.window) for b in range(B)]).unsqueeze(1)
    else:
        visible = block_visibility(positions, 0, k.shape[2], True, attn.window, mask).unsqueeze(1)
    if q.is_cuda:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=gqa)
    else:
        out = split_kv_attention(q, k, v, visible)
    return _row(out.transpose(1, 2).reshape(B, S, -1), attn.o_proj, group)


def vanilla_forward(model, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                    cache: Optional[KVCache] = None, mask: Optional[torch.Tensor] = None, *,
                    num_valid: Optional[torch.Tensor] = None, gather_logits: bool = False,
                    logits_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits of ``model`` computed the plain way (same signature as ``Transformer.forward``)."""
    if getattr(model.layers[0].mlp.down_proj, "strategy", "tree") != "tree":
        raise NotImplementedError("the vanilla control needs the 'tree' row layout (Megatron's weight shards)")
    args, group = model.args, model.tp_group
    k_pos = packed_key_positions(tokens, positions, cache)
    positions = model._positions(tokens, positions, cache)
    cos, sin = rope_cos_sin(positions, args.head_dim, args.rope_theta, args.rope_scaling)
    emb = model.embed_tokens
    local = tokens - emb.vocab_start_index
    outside = (local < 0) | (local >= emb.num_embeddings_per_partition)
    h = F.embedding(local.masked_fill(outside, 0), emb.weight).masked_fill(outside.unsqueeze(-1), 0)
    h = _ReduceFromTP.apply(h, group)
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        h = h + _attention(a, plain_rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.eps),
                           cos, sin, positions, mask, cache, i, group, k_pos)
        x = plain_rms_norm(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        mlp = layer.mlp
        h = h + _row(F.silu(_column(x, mlp.gate_proj, group)) * _column(x, mlp.up_proj, group), mlp.down_proj, group)
    h = plain_rms_norm(h, model.norm.weight, model.norm.eps)
    if logits_index is not None:
        h = select_positions(h, logits_index)
    weight = emb.weight if args.tie_word_embeddings else model.lm_head.weight
    logits = F.linear(_CopyToTP.apply(h, group), weight)
    if cache is not None:
        cache.advance(positions, num_valid, check=False)
    if gather_logits and group_size(group) > 1:
        logits = _GatherLastDim.apply(logits, group)
    return logits


def vanilla_loss(model, tokens: torch.Tensor, targets: torch.Tensor, positions: Optional[torch.Tensor] = None,
                 mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token cross-entropy ``[B, S]`` (fp32) through the vanilla path."""
    logits = vanilla_forward(model, tokens, positions, mask=mask)
    return _VanillaCrossEntropy.apply(logits, targets, model.tp_group, model.vocab_start)


def vanilla_log_probs(model, tokens, targets, positions=None, mask=None) -> torch.Tensor:
    return -vanilla_loss(model, tokens, targets, positions, mask)
