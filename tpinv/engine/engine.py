"""The generation engine: KV cache, continuous batching, sampling, stop conditions.

Invariant: a request's generated tokens, raw log-probs and sampled log-probs are the same
bits whatever else is batched with it, whichever cache slot it occupies, whenever it arrives,
and at every TP size -- and its raw log-probs equal the training forward's
(:meth:`~tpinv.models.Transformer.log_probs`) for the same tokens.  The engine adds no
reduction of its own: logits come from the invariant model (keys at absolute cache slots,
batch-invariant layers) gathered exactly over the vocabulary, the raw log-prob is the
training path's vocabulary log-softmax, and :mod:`tpinv.engine.sampling` draws from one row
with counter-based noise.  Every TP rank computes the same full-vocabulary rows, so every
rank draws the same token without any broadcast.

A step: the requests already running decode one token each in one forward over every cache
slot (idle slots are fed a dummy token at position 0); then newly admitted requests are
prefilled together in a temporary cache (right-padded, ``num_valid``), their keys and values
copied bitwise into their slots, and their first token drawn.  ``vanilla=True`` runs the same
loop through :func:`tpinv.models.vanilla.vanilla_forward` and plain ``torch.log_softmax``
(the control that shows what the invariant path removes).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from tpinv.core.compile import compile as compile_model
from tpinv.distributed.groups import LOCAL
from tpinv.engine.decode_graph import DecodeGraph
from tpinv.engine.sampling import sample_row, vocab_log_probs
from tpinv.engine.scheduler import Request, Result, Scheduler, SequenceState, error_result, validate_request
from tpinv.layers import vocab_parallel_log_probs
from tpinv.models.transformer import Transformer
from tpinv.models.vanilla import vanilla_forward

__all__ = ["Engine"]


class Engine:
    """Generate from a :class:`~tpinv.models.Transformer` (this rank's shard) with continuous batching.

    ``max_batch`` cache slots of ``max_context`` positions (default the model's
    ``max_position_embeddings``); ``token_budget`` caps the tokens of one step (decode tokens
    plus admitted prompts); ``slot_order`` is the order free slots are handed out in;
    ``eos_token_id`` defaults to the tokenizer's (a negative one: no EOS).  ``cuda_graph`` replays the decode step
    (one token for every slot) from a CUDA graph captured at the first decode: the same bits
    as the eager step, without its per-kernel host work (:meth:`close` frees it).  ``compile`` runs
the decode step through :func:`tpinv.compile` (torch.compile, full graph, compiled at the first
decode): the same bits as the eager step (``docs/compile.md``); prefill stays eager.  Under TP
    every rank of the model's group makes the same calls with the same requests.
    """

    def __init__(self, model: Transformer, *, tokenizer=None, max_batch: int = 8, max_context: Optional[int] = None,
                 token_budget: Optional[int] = None, eos_token_id: Optional[int] = None, vanilla: bool = False,
                 slot_order: Optional[Sequence[int]] = None, cuda_graph: bool = False, compile: bool = False):
        if not isinstance(model, Transformer):
            raise TypeError(f"model must be a tpinv.models.Transformer, got {type(model).__name__}")
        self.model, self.tokenizer, self.vanilla = model.eval(), tokenizer, bool(vanilla)
        self.max_context = int(max_context or model.args.max_position_embeddings)
        if self.max_context < 2:
            raise ValueError(f"max_context={max_context!r}: expected at least 2 positions")
        if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)
                                         or eos_token_id >= model.args.vocab_size):
            raise ValueError(f"eos_token_id={eos_token_id!r}: expected a token id below vocab_size="
                             f"{model.args.vocab_size} (or a negative one: no EOS)")
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_id", None)
        self.scheduler = Scheduler(max_batch, token_budget=token_budget, slot_order=slot_order)
        self.device = next(model.parameters()).device
        self.cache = model.new_cache(max_batch, self.max_context, device=self.device)
        self.decode_graph = DecodeGraph(
            lambda t, p, v: self._forward(t, p, self.cache, v), self.cache, model.args.vocab_size,
            device=self.device) if cuda_graph else None
        if compile and (cuda_graph or vanilla):
            raise ValueError("compile=True cannot be combined with "
                             f"{'cuda_graph=True' if cuda_graph else 'vanilla=True'}: compile the invariant "
                             f"model's eager decode step only")
        self.compiled_decode = compile_model(
            lambda t, p, v: self._forward(t, p, self.cache, v)) if compile else None
        self.compiled_decodes = 0
        self._errors: list[tuple[int, Result]] = []
        self._handles = 0
        self.steps = 0

    @classmethod
    def load(cls, source: str, *, tp_group=None, dtype: Optional[torch.dtype] = None, row_strategy: str = "tree",
             leaves: Optional[int] = None, init_seed: int = 0, tokenizer=None, **engine_kwargs) -> "Engine":
        """An engine over a named config (random weights from ``init_seed``), a tpinv checkpoint
        directory or a HF model directory, at the TP size of ``tp_group``; a tokenizer found in
        the directory is used unless ``tokenizer`` is given."""
        from tpinv.io.loading import load_model
        model, found = load_model(source, tp_group=tp_group, dtype=dtype, row_strategy=row_strategy, leaves=leaves,
                                  init_seed=init_seed)
        return cls(model, tokenizer=tokenizer if tokenizer is not None else found, **engine_kwargs)

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, request: Request) -> int:
        """Queue a request and return its handle; an invalid one becomes an error result of the next step."""
        self._handles += 1
        try:
            ids = validate_request(request, vocab_size=self.model.args.vocab_size, max_context=self.max_context,
                                   tokenizer=self.tokenizer)
        except (ValueError, TypeError) as e:
            self._errors.append((self._handles, error_result(getattr(request, "request_id", None), str(e))))
            return self._handles
        self.scheduler.add(SequenceState(request, ids, handle=self._handles))
        return self._handles

    def close(self) -> None:
        """Free the captured decode graph, if any (do this before ``destroy_process_group``
        when the model is tensor-parallel: the graph holds NCCL collectives)."""
        if self.decode_graph is not None:
            self.decode_graph.reset()

    def has_unfinished(self) -> bool:
        return bool(self._errors) or self.scheduler.has_work()

    def step(self) -> list[Result]:
        """Run one scheduler step; returns the requests that finished in it (errors first)."""
        return [result for _, result in self._step()]

    def _step(self) -> list[tuple[int, Result]]:
        finished, self._errors = self._errors, []
        decoding = list(self.scheduler.running.values())
        admitted = self.scheduler.admit()
        drawn: list[tuple[SequenceState, torch.Tensor]] = []
        with torch.no_grad():
            if decoding:
                drawn += list(zip(decoding, self._decode(decoding)))
            if admitted:
                drawn += list(zip(admitted, self._prefill(admitted)))
            for state, row in drawn:
                self._draw(state, row)
        for state, _ in drawn:
            if state.finish_reason is not None:
                self.scheduler.release(state)
                finished.append((state.handle, self._result(state)))
        self.steps += 1
        return finished

    def generate(self, requests: Sequence[Request], *, arrival_steps: Optional[Sequence[int]] = None) -> list[Result]:
        """Run ``requests`` to completion; results in input order.

        ``arrival_steps[i]`` (default 0) is the step, counted from this call, at which request
        ``i`` is submitted: requests join while others are in flight.
        """
        requests = list(requests)
        arrivals = [0] * len(requests) if arrival_steps is None else [int(a) for a in arrival_steps]
        if len(arrivals) != len(requests) or any(a < 0 for a in arrivals):
            raise ValueError(f"arrival_steps must hold one step >= 0 per request ({len(requests)}), got {arrivals}")
        index: dict[int, int] = {}          # handle -> input index
        results: dict[int, Result] = {}
        step = 0
        while len(results) < len(requests):
            for i, a in enumerate(arrivals):
                if a == step:
                    index[self.submit(requests[i])] = i
            for handle, result in self._step():
                if handle in index:
                    results[index[handle]] = result
            step += 1
        return [results[i] for i in range(len(requests))]

    # ---- model calls ------------------------------------------------------------------------

    def _forward(self, tokens, positions, cache, num_valid, logits_index=None) -> torch.Tensor:
        forward = (lambda *a, **k: vanilla_forward(self.model, *a, **k)) if self.vanilla else self.model
        return forward(tokens, positions, cache, num_valid=num_valid, gather_logits=True, logits_index=logits_index)

    def _decode(self, states: list[SequenceState]) -> torch.Tensor:
        """One token for each running request, in one forward over all slots: logits rows [n, V]."""
        B = self.scheduler.max_batch
        tokens = torch.zeros(B, 1, dtype=torch.int64)
        positions = torch.zeros(B, 1, dtype=torch.int64)
        valid = torch.zeros(B, dtype=torch.int64)
        for s in states:
            tokens[s.slot, 0], positions[s.slot, 0], valid[s.slot] = s.tokens[-1], s.length - 1, 1
        dev = self.device
        if self.decode_graph is not None:
            logits = self.decode_graph(tokens, positions, valid)
        elif self.compiled_decode is not None:
            logits = self.compiled_decode(tokens.to(dev), positions.to(dev), valid.to(dev))
            self.compiled_decodes += 1
        else:
            logits = self._forward(tokens.to(dev), positions.to(dev), self.cache, valid.to(dev))
        for s in states:
            s.cached = s.length
        return logits[[s.slot for s in states], 0]

    def _prefill(self, states: list[SequenceState]) -> torch.Tensor:
        """Prefill new requests together in a temporary cache, copy their KV into their slots."""
        lengths = [len(s.prompt_ids) for s in states]
        S = max(lengths)
        tokens = torch.zeros(len(states), S, dtype=torch.int64)
        for i, s in enumerate(states):
            tokens[i, :lengths[i]] = torch.tensor(s.prompt_ids, dtype=torch.int64)
        positions = torch.arange(S, dtype=torch.int64).expand(len(states), S).contiguous()
        temp = self.model.new_cache(len(states), S, device=self.device)
        dev = self.device
        last = torch.tensor(lengths, dtype=torch.int64, device=dev) - 1
        # the output layer runs on each request's last prompt position only: the same bits as that
        # row of the full logits (a logit depends on its own hidden row), no [B, S, V] tensor
        logits = self._forward(tokens.to(dev), positions.to(dev), temp, last + 1, logits_index=last[:, None])
        for i, (s, n) in enumerate(zip(states, lengths)):
            self.cache.k[:, s.slot, :, :n] = temp.k[:, i, :, :n]
            self.cache.v[:, s.slot, :, :n] = temp.v[:, i, :, :n]
            self.cache.lengths[s.slot] = n
            s.cached = n
        return logits[:, 0]

    def _raw_log_probs(self, row: torch.Tensor) -> torch.Tensor:
        """``log softmax(row)`` over the full vocabulary, fp32 (for top log-probs)."""
        if self.vanilla:
            return torch.log_softmax(row.float(), dim=-1)
        return vocab_log_probs(row.float(), self.model.leaves)

    def _token_log_prob(self, row: torch.Tensor, token: int) -> float:
        """The raw model log-prob of ``token``: the training forward's computation on one row."""
        target = torch.tensor([token], dtype=torch.int64, device=row.device)
        if self.vanilla:
            return float(torch.log_softmax(row.float(), dim=-1)[token])
        return float(vocab_parallel_log_probs(row[None], target, tp_group=LOCAL, leaves=self.model.leaves)[0])

    def _draw(self, state: SequenceState, row: torch.Tensor) -> None:
        req = state.request
        if not bool(torch.isfinite(row).all()):  # never sample from NaN/inf: this request ends in an error
            bad = int((~torch.isfinite(row)).sum())
            state.finish_reason = "error"
            state.error = (f"the model produced non-finite logits ({bad} of {row.numel()} NaN or inf) at position "
                           f"{state.next_position}; {len(state.tokens)} tokens were generated before it")
            return
        log_softmax = (lambda t: torch.log_softmax(t, dim=-1)) if self.vanilla else None
        out = sample_row(row, req.sampling, req.request_id, state.next_position, leaves=self.model.leaves,
                         log_softmax=log_softmax)
        state.tokens.append(out.token)
        state.logprobs.append(self._token_log_prob(row, out.token))
        state.sampled_logprobs.append(out.sampled_log_prob)
        if req.top_logprobs:
            values, ids = torch.sort(self._raw_log_probs(row), descending=True, stable=True)
            state.top_logprobs.append(values[:req.top_logprobs])
            state.top_token_ids.append(ids[:req.top_logprobs])
        state.finish_reason = self._finish_reason(state)

    def _finish_reason(self, state: SequenceState) -> Optional[str]:
        req, token = state.request, state.tokens[-1]
        if token == self.eos_token_id and not req.ignore_eos:
            return "eos"
        if token in req.stop_token_ids:
            return "stop"
        if req.stop:
            text = self._decode_text(state.tokens)
            hits = [text.find(s) for s in req.stop if s in text]
            if hits:
                state.text = text[:min(hits)]
                return "stop"
        if len(state.tokens) >= req.max_tokens or state.length >= self.max_context:
            return "length"
        return None

    def _decode_text(self, ids: list[int]) -> str:
        """Text of generated ids; ids past the tokenizer's vocabulary (padded model vocab) decode to nothing."""
        return self.tokenizer.decode([t for t in ids if t < self.tokenizer.vocab_size])

    def _result(self, state: SequenceState) -> Result:
        text = state.text
        if text is None and self.tokenizer is not None:
            text = self._decode_text(state.tokens)
        tops = state.top_logprobs
        return Result(state.request.request_id, list(state.prompt_ids), list(state.tokens),
                      torch.tensor(state.logprobs, dtype=torch.float32),
                      torch.tensor(state.sampled_logprobs, dtype=torch.float32), state.finish_reason, text=text,
                      top_logprobs=torch.stack(tops) if tops else None,
                      top_token_ids=torch.stack(state.top_token_ids) if tops else None, error=state.error)
