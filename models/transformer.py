"""The shared Qwen3 / Llama / Mistral decoder, built only from tpinv layers and ops.

Invariant: logits, per-token losses and every parameter gradient have the same bits at
every TP size dividing the leaf count, at every batch size and composition, and in a full
forward, a chunked prefill or token-by-token decoding with a :class:`KVCache`.  The model
adds no reduction of its own: every sum runs inside a tpinv layer or op in the contract's
order; the residual adds are elementwise (the one cross-head sum, the Qwen3 q/k norm
weights' gradient, lives in :class:`tpinv.layers.HeadRMSNorm`).  Hidden dropout (training only)
keys each element's mask by (sample id, token column, feature): the same masks at every TP
size, sequence split and micro-batch split.

Module names follow HF, so a HF checkpoint maps by stripping ``model.``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from tpinv.core.contract import DEFAULT_LEAVES, check_divisible
from tpinv.layers import (ColumnParallelLinear, HeadRMSNorm, RMSNorm, RowParallelLinear, VocabParallelEmbedding,
                          column_parallel_group, norm_and_rope, vocab_parallel_cross_entropy)
from tpinv.distributed.groups import group_size_rank
from tpinv.layers.common import ROW_STRATEGIES
from tpinv.layers.dropout import TokenDropout, check_dropout_rate
from tpinv.layers.kv_replication import gather_replica_heads, split_replica_heads
from tpinv.distributed.mappings import (gather_from_sequence_parallel_region,
                                        gather_from_tensor_model_parallel_region,
                                        scatter_to_sequence_parallel_region)
from tpinv.layers.linear_cross_entropy import check_chunk_tokens, linear_cross_entropy
from tpinv.models.args import ModelArgs, check_model_sizes, kv_replicas
from tpinv.models.kv_cache import KVCache
from tpinv.models.recompute import Recompute, checkpointed, recompute_active
from tpinv.models.replayed_layer import ReplayedLayer, eligible
from tpinv.ops import attention, rope_cos_sin, silu_mul

#: Std of the normal init of projection and embedding weights (HF ``initializer_range``).
INIT_STD = 0.02


@dataclasses.dataclass
class LayerConfig:
    """The ``config`` object tpinv layers read."""

    params_dtype: torch.dtype
    tpinv_leaves: int
    tpinv_row_strategy: str
    perform_initialization: bool = True
    use_cpu_initialization: bool = True
    sequence_parallel: bool = False
    tpinv_sequence_dim: int = 1  # activations are [B, S, H]


def normal_init(tensor: torch.Tensor) -> None:
    torch.nn.init.normal_(tensor, mean=0.0, std=INIT_STD)


class Attention(torch.nn.Module):
    def __init__(self, args: ModelArgs, config: LayerConfig, tp_group, tp_size: int):
        super().__init__()
        self.head_dim = args.head_dim
        self.tp_group = tp_group
        self.replicas = kv_replicas(args, tp_size)  # ranks holding each KV head (1: heads split)
        self.local_heads = args.num_heads // tp_size
        self.local_kv_heads = args.num_kv_heads * self.replicas // tp_size
        self.window = args.sliding_window
        hd, kvd = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim

        def column(out_size, bias, replicas=1):
            return ColumnParallelLinear(args.hidden_size, out_size, config=config, init_method=normal_init,
                                        bias=bias, gather_output=False, tp_group=tp_group, replicas=replicas)

        self.q_proj = column(hd, args.attention_bias)
        self.k_proj = column(kvd, args.attention_bias, self.replicas)
        self.v_proj = column(kvd, args.attention_bias, self.replicas)
        self.o_proj = RowParallelLinear(hd, args.hidden_size, config=config, init_method=normal_init,
                                        bias=args.attention_bias,
                                        input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)
        if args.qk_norm:
            self.q_norm = HeadRMSNorm(args.head_dim, args.rms_norm_eps, args.dtype, tp_group)
            self.k_norm = HeadRMSNorm(args.head_dim, args.rms_norm_eps, args.dtype, tp_group, self.replicas)
        else:
            self.q_norm = self.k_norm = None
        self.recompute_core = False  # Megatron's selective recompute (Transformer.set_recompute)

    def forward(self, x, cos, sin, positions, mask, cache: Optional[KVCache], layer: int, k_pos=None):
        q, k, v = column_parallel_group((self.q_proj, self.k_proj, self.v_proj), x)
        B, S, _ = q.shape  # the whole sequence (x is a sequence chunk under sequence parallelism)
        q = q.view(B, S, self.local_heads, self.head_dim)
        k = k.view(B, S, self.local_kv_heads, self.head_dim)
        v = v.view(B, S, self.local_kv_heads, self.head_dim)
        q, k = norm_and_rope(q, k, cos, sin, self.q_norm, self.k_norm)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.append(layer, k, v, positions, check=False)  # checked once per step
        q = gather_replica_heads(q, self.tp_group, self.replicas)  # no-op unless KV heads are replicated
        run = checkpointed if self.recompute_core and recompute_active(self) else _call
        out = run(attention, q, k, v, positions, causal=True, window=self.window, mask=mask, k_pos=k_pos)
        out = split_replica_heads(out, self.tp_group, self.replicas)
        out = out.transpose(1, 2).reshape(B, S, self.local_heads * self.head_dim)
        return self.o_proj(out)[0]


class MLP(torch.nn.Module):
    def __init__(self, args: ModelArgs, config: LayerConfig, tp_group):
        super().__init__()

        def column():
            return ColumnParallelLinear(args.hidden_size, args.intermediate_size, config=config,
                                        init_method=normal_init, bias=False, tp_group=tp_group)

        self.gate_proj = column()
        self.up_proj = column()
        self.down_proj = RowParallelLinear(args.intermediate_size, args.hidden_size, config=config,
                                           init_method=normal_init, bias=False, input_is_parallel=True,
                                           skip_bias_add=False, tp_group=tp_group)

    def forward(self, x):
        gate, up = column_parallel_group((self.gate_proj, self.up_proj), x)
        return self.down_proj(silu_mul(gate, up))[0]


def _norm(args: ModelArgs, config: LayerConfig, tp_group) -> RMSNorm:
    return RMSNorm(args.hidden_size, args.rms_norm_eps, args.dtype,
                   sequence_parallel_group=tp_group if config.sequence_parallel else None)


class DecoderLayer(torch.nn.Module):
    def __init__(self, args: ModelArgs, config: LayerConfig, tp_group, tp_size: int):
        super().__init__()
        self.input_layernorm = _norm(args, config, tp_group)
        self.self_attn = Attention(args, config, tp_group, tp_size)
        self.post_attention_layernorm = _norm(args, config, tp_group)
        self.mlp = MLP(args, config, tp_group)
        # eager training calls at TP=1 replay a recorded program (tpinv.models.replayed_layer)
        self.replay = ReplayedLayer(type(self).__name__) if tp_size == 1 and not config.sequence_parallel else None
        self.recomputed = False

    def forward(self, x, cos, sin, positions, mask, cache, layer, k_pos=None, dropout=None):
        """``dropout``: a :class:`tpinv.layers.dropout.TokenDropout` (training with hidden dropout)
        applied to the attention and MLP outputs before each residual add (sites ``4*layer``, ``+1``).

        An eligible eager training call (:func:`tpinv.models.replayed_layer.eligible`: TP=1, no
        cache, mask, packed positions, dropout or recompute) runs as one node replaying its program:
        the same bits as the modular code below, which it was recorded from and checked against."""
        if (self.replay is not None and cache is None and mask is None and k_pos is None and dropout is None
                and not self.recomputed and eligible(x, self)):
            return self.replay(self._training_call, x, (cos, sin, positions), tuple(self.parameters()))
        return self._modular(x, cos, sin, positions, mask, cache, layer, k_pos, dropout)

    def _training_call(self, x, cos, sin, positions):
        return self._modular(x, cos, sin, positions, None, None, 0)

    def _modular(self, x, cos, sin, positions, mask, cache, layer, k_pos=None, dropout=None):
        a = self.self_attn(self.input_layernorm(x), cos, sin, positions, mask, cache, layer, k_pos)
        h = x + (a if dropout is None else dropout(a, 4 * layer))
        m = self.mlp(self.post_attention_layernorm(h))
        return h + (m if dropout is None else dropout(m, 4 * layer + 1))


def _call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def packed_key_positions(tokens: torch.Tensor, positions: Optional[torch.Tensor],
                         cache: Optional[KVCache]) -> Optional[torch.Tensor]:
    """The key positions of a packed row (no cache, positions other than ``arange(S)``), else None.

    Under torch.compile every explicit ``positions`` without a cache takes the packed path (the
    test compares tensor values, which a graph cannot branch on); for ``arange(S)`` that path
    computes the unpacked bits (``tests/unit/test_attention_packed.py``)."""
    if cache is not None or positions is None or positions.shape != tokens.shape:
        return None
    if torch.compiler.is_compiling():
        return positions
    S = tokens.shape[1]
    if torch.equal(positions, torch.arange(S, device=positions.device).expand_as(positions)):
        return None
    return positions


def select_positions(h: torch.Tensor, index: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
    """Rows ``h[b, index[b, j]]`` of ``h [B, S, H]``: ``[B, n, H]`` (an exact copy)."""
    if sequence_parallel:
        raise NotImplementedError("logits_index with sequence_parallel=True is not supported (the rows live "
                                  "on different ranks); build the model without sequence parallelism")
    if index.dtype != torch.int64 or index.dim() != 2 or index.shape[0] != h.shape[0]:
        raise ValueError(f"logits_index must be int64 of shape [B={h.shape[0]}, n], got {index.dtype} "
                         f"{list(index.shape)}")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= h.shape[1]):
        raise ValueError(f"logits_index holds positions outside [0, {h.shape[1]})")
    return h.gather(1, index.to(h.device).unsqueeze(-1).expand(-1, -1, h.shape[-1]))


class Transformer(torch.nn.Module):
    """Decoder-only LM; ``forward`` returns this rank's vocabulary shard of the logits."""

    def __init__(self, args: ModelArgs, *, tp_group: Optional[dist.ProcessGroup] = None,
                 leaves: int = DEFAULT_LEAVES, row_strategy: str = "tree", sequence_parallel: bool = False,
                 hidden_dropout: float = 0.0, attention_dropout: float = 0.0, dropout_seed: int = 0):
        super().__init__()
        # Megatron's names; dropout runs in training mode only (eval() and the engine: none)
        self.hidden_dropout = check_dropout_rate("hidden_dropout", hidden_dropout)
        if check_dropout_rate("attention_dropout", attention_dropout) > 0.0:
            raise NotImplementedError(
                f"attention_dropout={attention_dropout}: tpinv's fused attention kernels (tpinv.ops.attention, "
                f"forward and backward) take no dropout mask on the probabilities; use attention_dropout=0 "
                f"(hidden_dropout is supported)")
        self.attention_dropout, self.dropout_seed = 0.0, int(dropout_seed)
        if row_strategy not in ROW_STRATEGIES:
            raise ValueError(f"row_strategy={row_strategy!r}: expected one of {ROW_STRATEGIES}")
        self.args, self.tp_group, self.leaves = args, tp_group, leaves
        self.tp_size, self.tp_rank = group_size_rank(tp_group)
        check_model_sizes(args, self.tp_size, leaves)
        # Megatron's sequence_parallel: norms and residuals on sequence chunks (a no-op at TP=1)
        self.sequence_parallel = bool(sequence_parallel) and self.tp_size > 1
        if self.sequence_parallel and args.attention_bias:
            raise NotImplementedError("sequence_parallel=True with attention_bias=True is not supported "
                                      "(the o_proj bias would be added on sequence chunks)")
        config = LayerConfig(params_dtype=args.dtype, tpinv_leaves=leaves, tpinv_row_strategy=row_strategy,
                             sequence_parallel=self.sequence_parallel)
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, init_method=normal_init,
                                                   config=config, tp_group=tp_group)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(args, config, tp_group, self.tp_size) for _ in range(args.num_layers))
        self.norm = _norm(args, config, tp_group)
        self.lm_head = ColumnParallelLinear(args.hidden_size, args.vocab_size, config=config,
                                            init_method=normal_init, bias=False, gather_output=False,
                                            skip_weight_param_allocation=args.tie_word_embeddings,
                                            tp_group=tp_group)
        self.recompute = Recompute(total_layers=args.num_layers)

    def set_recompute(self, granularity: Optional[str] = None, method: Optional[str] = None,
                      num_layers: Optional[int] = None) -> "Transformer":
        """Megatron's activation recompute (:mod:`tpinv.models.recompute`); the same bits as without."""
        self.recompute = Recompute(granularity, method, num_layers, self.args.num_layers)
        for layer in self.layers:
            layer.self_attn.recompute_core = self.recompute.selective
            layer.recomputed = self.recompute.granularity is not None   # no replay under a checkpoint
        return self

    def _run_layers(self, start, end, h, cos, sin, positions, mask, cache, k_pos, dropout):
        for i in range(start, end):
            h = self.layers[i](h, cos, sin, positions, mask, cache, i, k_pos, dropout)
        return h

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * (self.args.vocab_size // self.tp_size)

    def new_cache(self, batch: int, max_len: int, device: Optional[torch.device] = None) -> KVCache:
        """An empty KV cache for this rank's KV heads."""
        return KVCache(batch, max_len, self.args.num_layers, self.layers[0].self_attn.local_kv_heads,
                       self.args.head_dim, dtype=self.args.dtype, device=device)

    def _positions(self, tokens, positions, cache):
        """The step's positions, checked once (the layers' cache writes do not re-check them)."""
        B, S = tokens.shape
        if positions is None:
            if cache is not None:
                positions = cache.next_positions(S).to(tokens.device)
                cache.check_positions(positions)
                return positions
            return torch.arange(S, device=tokens.device).expand(B, S).contiguous()
        if positions.dtype != torch.int64 or tuple(positions.shape) != (B, S):
            raise ValueError(f"positions must be int64 of shape [B, S] = [{B}, {S}], got "
                             f"{positions.dtype} {list(positions.shape)}")
        if cache is not None:
            cache.check_positions(positions)
        return positions

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, mask: Optional[torch.Tensor] = None, *,
                num_valid: Optional[torch.Tensor] = None, gather_logits: bool = False,
                sample_ids: Optional[torch.Tensor] = None,
                logits_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[B, S, V/C]`` in ``args.dtype`` (``[B, S, V]`` with ``gather_logits``, exact).

        ``logits_index`` (int64 ``[B, n]``): the output layer runs on those positions of each
        row only and the logits are ``[B, n, V/C]`` -- the same bits as those rows of the full
        logits, since a logit depends on its own hidden row only (no ``[B, S, V]`` tensor).

        ``positions [B, S]`` default to ``arange(S)`` after each request's cache length.
        With ``cache`` the new keys/values are written at their positions and attention
        runs against the whole cache; each request's length then grows by its first
        ``num_valid[b]`` tokens (default ``S``; right-padded rows pass their lengths).
        ``mask`` is a bool ``[B, S, T]`` visibility mask over key slots (``T = S`` without a
        cache, ``T = cache.max_len`` with one), combined with the causal (and window) mask.
        Without a cache, ``positions`` other than ``arange(S)`` make a packed row: token ``j``'s
        key sits at ``positions[:, j]`` (:func:`tpinv.ops.attention` with ``k_pos``), causality
        follows positions, and ``mask`` separates the documents or turns packed in the row.
        In training mode with ``hidden_dropout > 0``, ``sample_ids`` (int64 ``[B]``, each row's
        global sample index in the run) key the dropout masks (:mod:`tpinv.layers.dropout`).
        """
        h = self.hidden_states(tokens, positions, cache, mask, num_valid=num_valid, sample_ids=sample_ids)
        if logits_index is not None:
            h = select_positions(h, logits_index, self.sequence_parallel)
        logits = self.lm_head(h, weight=self.embed_tokens.weight if self.args.tie_word_embeddings else None)[0]
        if gather_logits and self.tp_size > 1:
            logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)
        return logits

    def hidden_states(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                      cache: Optional[KVCache] = None, mask: Optional[torch.Tensor] = None, *,
                      num_valid: Optional[torch.Tensor] = None,
                      sample_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The final norm's output ``[B, S, H]``, the output layer's input (arguments as :meth:`forward`;
        with sequence parallelism this rank's sequence chunk)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape [B, S], got {list(tokens.shape)}")
        k_pos = packed_key_positions(tokens, positions, cache)
        positions = self._positions(tokens, positions, cache)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, self.args.rope_scaling)
        h = self.embed_tokens(tokens)
        if self.sequence_parallel:
            if cache is not None:
                raise NotImplementedError("sequence_parallel=True is for training: build the model without it "
                                          "to decode with a KV cache")
            check_divisible("sequence length", tokens.shape[1], self.tp_size, "tensor-parallel size "
                            "(sequence_parallel=True)")
            h = scatter_to_sequence_parallel_region(h, self.tp_group, dim=1)
        dropout = self._dropout(sample_ids, h.shape[1])
        active = recompute_active(self) and self.recompute.granularity is not None
        if active and cache is not None:
            raise NotImplementedError(f"recompute_granularity={self.recompute.granularity!r} is for training: "
                                      f"run a forward with a KV cache in eval mode or under torch.no_grad()")
        for start, end, again in self.recompute.segments() if active else [(0, len(self.layers), False)]:
            h = (checkpointed if again else _call)(self._run_layers, start, end, h, cos, sin, positions, mask,
                                                   cache, k_pos, dropout)
        h = self.norm(h)
        if cache is not None:
            cache.advance(positions, num_valid, check=False)
        return h

    def _whole_sequence(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` over the whole sequence: with sequence parallelism all-gathered exactly (its
        gradient keeps this rank's chunk of the full, identical ``dX``); else ``h``."""
        if not self.sequence_parallel:
            return h
        return gather_from_sequence_parallel_region(h.transpose(0, 1).contiguous(), self.tp_group,
                                                    tensor_parallel_output_grad=False).transpose(0, 1)

    @property
    def output_weight(self) -> torch.Tensor:
        """This rank's shard ``[V/C, H]`` of the output layer (the embedding's when tied)."""
        return self.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight

    def _dropout(self, sample_ids: Optional[torch.Tensor], local_len: int) -> Optional[TokenDropout]:
        """This forward's hidden dropout: None unless training with ``hidden_dropout > 0``."""
        if not (self.training and self.hidden_dropout > 0.0):
            return None
        if sample_ids is None:
            raise ValueError(f"hidden_dropout={self.hidden_dropout} in training mode needs sample_ids (int64 [B], "
                             f"each row's global sample index) to key its masks; call model.eval() for "
                             f"inference")
        first = self.tp_rank * local_len if self.sequence_parallel else 0  # this rank's sequence chunk
        return TokenDropout(self.hidden_dropout, self.dropout_seed, sample_ids, first)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, positions: Optional[torch.Tensor] = None,
             mask: Optional[torch.Tensor] = None, sample_ids: Optional[torch.Tensor] = None, *,
             chunk_tokens: Optional[int] = None) -> torch.Tensor:
        """Per-token cross-entropy ``[B, S]`` in fp32 (vocab-parallel, invariant).

        ``chunk_tokens``: the output layer and the cross-entropy run that many tokens at a time
        (:func:`tpinv.layers.linear_cross_entropy`), so at most ``chunk_tokens x V/C`` logits
        exist at once; the loss and every gradient have the same bits as ``None`` (whole).
        """
        if targets.shape != tokens.shape:
            raise ValueError(f"targets must have the shape of tokens, {list(tokens.shape)}, got "
                             f"{list(targets.shape)}")
        if check_chunk_tokens(chunk_tokens) is not None:
            return linear_cross_entropy(self._whole_sequence(self.hidden_states(tokens, positions, mask=mask,
                                                                                   sample_ids=sample_ids)),
                                        self.output_weight, targets,
                                        tp_group=self.tp_group, leaves=self.leaves, chunk_tokens=chunk_tokens)
        logits = self.forward(tokens, positions, mask=mask, sample_ids=sample_ids)
        return vocab_parallel_cross_entropy(logits, targets, tp_group=self.tp_group, leaves=self.leaves)

    def log_probs(self, tokens: torch.Tensor, targets: torch.Tensor, positions: Optional[torch.Tensor] = None,
                  mask: Optional[torch.Tensor] = None, *, chunk_tokens: Optional[int] = None) -> torch.Tensor:
        """Per-token ``log p(target)`` ``[B, S]`` in fp32: ``-loss``, the same bits at every TP size
        and every ``chunk_tokens``."""
        return -self.loss(tokens, targets, positions, mask, chunk_tokens=chunk_tokens)
