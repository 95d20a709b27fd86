"""Dropout for megatron-core models whose mask is keyed by samples: TP-, micro-batch- and DP-invariant.

Invariant kept: the keep bit of an element depends only on the dropout seed, the site (which
layer and which dropout in it) and where the element sits in the *global* computation --

* hidden states (megatron's ``[s, b, h]``: embedding dropout, both bias-dropout-adds): the row's
  global sample id, the token's position in the whole sequence (a sequence-parallel rank's chunk
  starts at its global position) and the feature -- the words of tpinv's own models
  (:func:`tpinv.layers.dropout.token_dropout`), so a row gets the mask it gets there;
* attention probabilities (``[b, heads, sq, sk]``): the sample id, the global head (a TP rank's
  heads start at ``rank * heads_per_rank``), the query and the key position.

The mask is a counter-based integer hash computed with exact int64 tensor ops
(:mod:`tpinv.layers.dropout`); no random-number generator (and no megatron RNG tracker) is
involved.  So the masks are the same at every TP size, however a global batch is cut into
micro-batches, and on every data-parallel rank layout, as long as a row's sample id is.

Sample ids.  megatron's model is not given them, so by default each site counts the rows (samples)
of its training forwards: a row's id is its index in the stream of samples this rank's model has
consumed.  With one data-parallel rank that is the row's index in the global sample stream,
whatever the micro-batch size.  With several data-parallel ranks (or to carry the ids across a
checkpoint resume) the caller names the rows: :func:`dropout_sample_ids` around the model call sets
the global ids of the micro-batch's rows (``docs/megatron.md`` shows megatron's sampler layout).

Under megatron's activation recompute (``tensor_parallel.checkpoint``: ``recompute_granularity``
"full" or "selective") a checkpointed forward runs twice, once without gradients and again during
backward.  A call made inside megatron's checkpoint forward records its sample ids, and its
recompute (inside the checkpoint, during backward) takes them back in the order they were recorded
-- the order megatron's schedules run the backwards of a module's micro-batches.  So the masks, the
loss and the gradients are the bits of the run without recompute.
"""
from __future__ import annotations

import collections
import contextlib
import sys
from typing import Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from tpinv.layers.dropout import apply_keep, check_sample_ids, dropout_key, keep_mask, token_keep_mask

#: Layouts of the tensors a site drops: megatron's hidden states and its attention probabilities.
LAYOUTS = ("sbh", "bnqk")


def sbh_keep_mask(shape, p: float, key: int, sample_ids: torch.Tensor, first_token: int = 0) -> torch.Tensor:
    """Keep mask of hidden states ``[s, b, h]`` keyed by (``sample_ids[b]``, ``first_token + s``, ``h``):
    tpinv's own token mask, sequence first."""
    s, b, h = shape
    return token_keep_mask((b, s, h), p, key, sample_ids, first_token).transpose(0, 1).contiguous()


def bnqk_keep_mask(shape, p: float, key: int, sample_ids: torch.Tensor, first_head: int = 0) -> torch.Tensor:
    """Keep mask of attention probabilities ``[b, n, sq, sk]`` keyed by (``sample_ids[b]``,
    ``first_head + n``, query, key)."""
    b, n, sq, sk = shape
    dev = sample_ids.device
    words = (sample_ids.to(torch.int64).view(b, 1, 1, 1),
             (torch.arange(n, dtype=torch.int64, device=dev) + first_head).view(1, n, 1, 1),
             torch.arange(sq, dtype=torch.int64, device=dev).view(1, 1, sq, 1),
             torch.arange(sk, dtype=torch.int64, device=dev).view(1, 1, 1, sk))
    return keep_mask(key, words, p)


def _megatron_checkpoint_phase() -> Optional[str]:
    """``"forward"`` inside megatron's checkpointed forward, ``"recompute"`` inside its recompute, else None."""
    mrandom = sys.modules.get("megatron.core.tensor_parallel.random")
    flag = getattr(mrandom, "is_checkpointing", None)
    if flag is None or not flag():
        return None
    # megatron runs bias-dropout-add under enable_grad even in the checkpointed forward: the
    # recompute is told apart by running inside the autograd engine's backward
    return "recompute" if torch._C._current_graph_task_id() != -1 else "forward"


class InvariantDropout(torch.nn.Module):
    """Drop-in for ``torch.nn.Dropout`` on megatron's ``layout`` ("sbh" hidden states, "bnqk"
    attention probabilities); ``tp_group``: the group sharding the heads ("bnqk") or, with
    ``sequence_parallel``, the sequence ("sbh")."""

    def __init__(self, p: float, *, seed: int, site: int, layout: str = "sbh", tp_group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
        self.p, self.seed, self.site, self.layout = float(p), int(seed), int(site), layout
        self.sequence_parallel = bool(sequence_parallel)
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self.samples = 0  # rows seen by counted training forwards
        self.sample_ids: Optional[torch.Tensor] = None  # set by dropout_sample_ids
        self._to_recompute: collections.deque = collections.deque()  # ids of checkpointed forwards

    def _counted_ids(self, rows: int, device) -> torch.Tensor:
        ids = torch.arange(self.samples, self.samples + rows, dtype=torch.int64, device=device)
        self.samples += rows
        return ids

    def _row_ids(self, rows: int, device) -> torch.Tensor:
        phase = _megatron_checkpoint_phase()
        if phase == "recompute":
            if not self._to_recompute:
                raise RuntimeError(f"dropout site {self.site}: a recomputed call without a recorded checkpointed "
                                   f"forward (megatron's recompute ran a forward it did not run before)")
            return self._to_recompute.popleft()
        if self.sample_ids is None:
            ids = self._counted_ids(rows, device)
        else:
            ids = self.sample_ids.to(device)
            if ids.shape[0] != rows:
                raise ValueError(f"dropout site {self.site}: dropout_sample_ids gave {ids.shape[0]} ids for a "
                                 f"micro-batch of {rows} rows")
        if phase == "forward":
            self._to_recompute.append(ids)
        return ids

    def forward(self, x: torch.Tensor, p: Optional[float] = None, training: Optional[bool] = None) -> torch.Tensor:
        p = self.p if p is None else float(p)
        if not (self.training if training is None else training) or p == 0.0:
            return x
        key = dropout_key(self.seed, self.site)
        if self.layout == "sbh":
            if x.dim() != 3:
                raise ValueError(f"dropout site {self.site}: expected hidden states [s, b, h], got {list(x.shape)}")
            first = self.tp_rank * x.shape[0] if self.sequence_parallel else 0
            ids = self._row_ids(x.shape[1], x.device)
            keep = None if p >= 1.0 else sbh_keep_mask(x.shape, p, key, ids, first)
        else:
            if x.dim() != 4:
                raise ValueError(f"dropout site {self.site}: expected attention probabilities [b, heads, sq, sk], "
                                 f"got {list(x.shape)}")
            ids = self._row_ids(x.shape[0], x.device)
            keep = None if p >= 1.0 else bnqk_keep_mask(x.shape, p, key, ids, self.tp_rank * x.shape[1])
        return torch.zeros_like(x) if keep is None else apply_keep(x, keep, p)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}, layout={self.layout}, TP={self.tp_size}"


class InvariantBiasDropoutAdd(torch.nn.Module):
    """megatron's ``get_bias_dropout_add(training, fused)`` protocol with :class:`InvariantDropout`."""

    def __init__(self, *, seed: int, site: int, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        self.dropout = InvariantDropout(0.0, seed=seed, site=site, tp_group=tp_group,
                                        sequence_parallel=sequence_parallel)

    def forward(self, training: bool, fused: bool = False):
        def bias_dropout_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)
            return residual + self.dropout(x, prob, training)
        return bias_dropout_add


def dropout_sites(model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> list[InvariantDropout]:
    """Every :class:`InvariantDropout` of ``model`` (a module or megatron's list of model chunks)."""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, InvariantDropout)]


@contextlib.contextmanager
def dropout_sample_ids(model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
                       sample_ids: torch.Tensor) -> Iterator[None]:
    """Within the block, the training forwards of ``model`` key their dropout masks by
    ``sample_ids`` (int64 ``[micro_batch]``, each row's global sample id in ``[0, 2**32)``)
    instead of each site's sample count.  Wrap the model call of megatron's ``forward_step``."""
    sample_ids = check_sample_ids(sample_ids)
    sites = dropout_sites(model)
    if not sites:
        raise ValueError("dropout_sample_ids: the model has no tpinv dropout; build it with "
                         "tpinv.megatron.build_gpt_model or swap_to_tpinv")
    previous = [site.sample_ids for site in sites]
    for site in sites:
        site.sample_ids = sample_ids
    try:
        yield
    finally:
        for site, ids in zip(sites, previous):
            site.sample_ids = ids


def _is_stock_bda(fn) -> bool:
    return getattr(fn, "__name__", "") == "get_bias_dropout_add"


def install_invariant_dropout(model: torch.nn.Module, *, tp_group, seed: int) -> int:
    """Replace every dropout of a megatron-core GPT model with the invariant one; returns how
    many sites were replaced.  Raises ``NotImplementedError`` for a dropout it cannot replace."""
    sp = bool(getattr(getattr(model, "config", None), "sequence_parallel", False))
    count = 0
    for name, module in list(model.named_modules()):
        layer = getattr(module, "layer_number", None)
        for attr, k in (("self_attn_bda", 0), ("mlp_bda", 1)):
            if layer is not None and _is_stock_bda(getattr(module, attr, None)):
                setattr(module, attr, InvariantBiasDropoutAdd(seed=seed, site=4 * layer + k, tp_group=tp_group,
                                                              sequence_parallel=sp))
                count += 1
        drop = getattr(module, "attention_dropout", None)
        if isinstance(drop, torch.nn.Dropout) and layer is not None:
            module.attention_dropout = InvariantDropout(drop.p, seed=seed, site=4 * layer + 2, layout="bnqk",
                                                        tp_group=tp_group)
            count += 1
        drop = getattr(module, "embedding_dropout", None)
        if isinstance(drop, torch.nn.Dropout):
            module.embedding_dropout = InvariantDropout(drop.p, seed=seed, site=3, tp_group=tp_group,
                                                        sequence_parallel=sp)
            count += 1
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            raise NotImplementedError(
                f"{name} is a torch.nn.Dropout(p={module.p}) on megatron's RNG path, whose mask depends on the "
                f"TP size; tpinv.megatron cannot replace it: set its dropout to 0")
        for attr in ("self_attn_bda", "mlp_bda", "cross_attn_bda"):
            if _is_stock_bda(getattr(module, attr, None)) and getattr(module, "hidden_dropout", 0.0):
                raise NotImplementedError(
                    f"{name}.{attr} is megatron's RNG bias-dropout-add (hidden_dropout={module.hidden_dropout}), "
                    f"not TP-invariant: set hidden_dropout=0")
    _check_recompute_support(model)
    return count


def _check_recompute_support(model: torch.nn.Module) -> None:
    """Refuse dropout under megatron's recompute where megatron cannot say when it recomputes."""
    cfg = getattr(model, "config", None)
    if not getattr(cfg, "recompute_granularity", None):
        return
    if not (getattr(cfg, "hidden_dropout", 0.0) or getattr(cfg, "attention_dropout", 0.0)):
        return
    import megatron.core.tensor_parallel.random as mrandom
    if not hasattr(mrandom, "is_checkpointing"):
        raise NotImplementedError(
            f"recompute_granularity={cfg.recompute_granularity!r} with dropout needs megatron-core's "
            f"tensor_parallel.random.is_checkpointing (to replay a recomputed dropout's mask), which this "
            f"megatron-core lacks: set hidden_dropout=0 and attention_dropout=0, or turn recompute off")
