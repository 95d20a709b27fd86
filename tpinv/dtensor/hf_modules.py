"""HF op swaps for the invariant DTensor plan: tpinv's fixed-order ops in HF's modules.

HF's Qwen3/Llama/Mistral compute RMSNorm, RoPE, SiLU and eager attention with plain torch;
``F.silu`` depends on an element's position in its tensor (whose size changes with TP), and
the norms and softmax sum in whatever order ATen picks.  These ``ParallelStyle`` classes
replace each module's ``forward`` with tpinv's ops (:func:`tpinv.ops.rms_norm`,
:func:`~tpinv.ops.apply_rope`, :func:`~tpinv.ops.silu_mul`, :func:`~tpinv.ops.attention`), so
a HF model under :func:`tpinv.dtensor.invariant_plan` computes the same bits as tpinv's own
model, at every TP size.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from tpinv.core.contract import InvarianceError
from tpinv.dtensor.styles import ShardedHeads, replace_forward
from tpinv.layers import head_rms_norm
from tpinv.layers.kv_replication import gather_replica_heads, split_replica_heads
from tpinv.ops import apply_rope, attention, rms_norm, rope_cos_sin, silu_mul

__all__ = ["TpinvRMSNorm", "TpinvHeadRMSNorm", "TpinvRotary", "TpinvMLP", "TpinvAttention"]


def _eps(module: nn.Module) -> float:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None:
        raise TypeError(f"{type(module).__name__} is not an RMSNorm (no variance_epsilon / eps)")
    return float(eps)


class TpinvRMSNorm(ParallelStyle):
    """An HF RMSNorm computes tpinv's ``rms_norm`` (fixed-order hidden sum, same semantics)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        eps = _eps(module)
        replace_forward(module, lambda mod, x: rms_norm(x, mod.weight, eps))
        return module


class TpinvHeadRMSNorm(ParallelStyle):
    """Qwen3's q/k norm on ``[..., heads, D]``: tpinv's ``head_rms_norm``; the shared weight's
    gradient is summed over all heads of all ranks in a fixed order (as tpinv's own model
    does), so it is the same on every rank and at every TP size.  ``replicas``: ranks holding
    each head (the k norm with replicated KV heads: one copy of each head's sum is kept)."""

    def __init__(self, replicas: int = 1):
        super().__init__()
        self.replicas = replicas

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        eps, group, replicas = _eps(module), device_mesh.get_group(), self.replicas
        replace_forward(module, lambda mod, x: head_rms_norm(x, mod.weight, eps, group, replicas))
        return module


class TpinvRotary(ParallelStyle):
    """An HF rotary embedding returns tpinv's fp32 ``rope_cos_sin`` tables ``[B, S, D]``."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict]):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        replace_forward(module, lambda mod, x, position_ids: rope_cos_sin(
            position_ids, self.head_dim, self.theta, self.scaling))
        return module


class TpinvMLP(ParallelStyle):
    """``down_proj(silu_mul(gate_proj(x), up_proj(x)))``: a position-independent SiLU."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        act = getattr(getattr(module, "config", None), "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"{type(module).__name__}: hidden_act={act!r}; only 'silu'")
        replace_forward(module, lambda mod, x: mod.down_proj(silu_mul(mod.gate_proj(x), mod.up_proj(x))))
        return module


def _visibility(attention_mask: Optional[torch.Tensor], B: int, S: int, T: int):
    """HF's 4-D mask (additive float or bool, ``[B|1, 1, S, >=T]``) as bool ``[B, S, T]``."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4:
        raise ValueError(f"expected HF's 4-D attention mask [B, 1, S, T], got {tuple(attention_mask.shape)}")
    m = attention_mask[:, 0, :, :T]
    visible = m if m.dtype == torch.bool else m == 0
    return visible.expand(B, S, T).contiguous()


class TpinvAttention(ShardedHeads):
    """HF self-attention on local heads with tpinv's RoPE and attention.

    Key slot ``j`` is the ``j``-th token of the sequence (with an HF cache: of the cache);
    HF's mask (padding, causal, sliding window) is kept and combined with tpinv's causal
    and window masks, which it implies.  Returns ``(output, None)`` as HF's modules do.
    With TP above the KV heads the rank's KV head is shared by ``R`` ranks: the query heads of
    the replica group are gathered before attention and split after it
    (:mod:`tpinv.layers.kv_replication`), so each replica runs TP=1's call for that KV head.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, replicas: int = 1):
        super().__init__(num_heads, num_kv_heads, replicas)
        self.head_dim = head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        replicas, group = self.replicas, device_mesh.get_group()
        if hasattr(module, "sliding_window"):  # Qwen3: per layer type; Mistral: from the config
            window = module.sliding_window
        else:
            window = getattr(getattr(module, "config", None), "sliding_window", None)
        D = self.head_dim

        def forward(mod, hidden_states, position_embeddings, attention_mask=None,
                    past_key_values=None, **kwargs):
            if mod.training and getattr(mod, "attention_dropout", 0.0):
                raise NotImplementedError("attention dropout is not supported by the invariant plan")
            B, S, _ = hidden_states.shape
            q = mod.q_proj(hidden_states).view(B, S, mod.num_heads, D)
            k = mod.k_proj(hidden_states).view(B, S, mod.num_key_value_heads, D)
            v = mod.v_proj(hidden_states).view(B, S, mod.num_key_value_heads, D).transpose(1, 2)
            if getattr(mod, "q_norm", None) is not None:
                q, k = mod.q_norm(q), mod.k_norm(k)
            cos, sin = (t[0] if t.shape[0] == 1 else t for t in position_embeddings)
            q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
            past = 0
            if past_key_values is not None:
                past = past_key_values.get_seq_length(mod.layer_idx)
                k, v = past_key_values.update(k, v, mod.layer_idx)
            q = gather_replica_heads(q, group, replicas)  # no-op unless KV heads are replicated
            mask = _visibility(attention_mask, B, S, k.shape[2])
            dropped = past + S - k.shape[2]  # a sliding-window cache returns the last slots only
            if dropped > 0:
                if window is None or dropped > past - window + 1:
                    raise InvarianceError(f"the cache dropped {dropped} key slots a query may see")
                k, v = (torch.cat([t.new_zeros(B, t.shape[1], dropped, D), t], dim=2) for t in (k, v))
                mask = None if mask is None else torch.cat([mask.new_zeros(B, S, dropped), mask], dim=2)
            slots = torch.arange(past, past + S, device=q.device).expand(B, S).contiguous()
            out = split_replica_heads(attention(q, k, v, slots, causal=True, window=window, mask=mask),
                                      group, replicas)
            return mod.o_proj(out.transpose(1, 2).reshape(B, S, mod.num_heads * D)), None

        replace_forward(module, forward)
        return module
