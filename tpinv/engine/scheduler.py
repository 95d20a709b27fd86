"""Requests, results, per-request validation and the continuous-batching scheduler.

The scheduler decides *when* a request runs and *which KV-cache slot* it occupies; it never
changes what the request computes.  That is the invariant the engine relies on: the model
and the sampler are batch-invariant by construction, so a request's tokens and log-probs are
the same bits whatever slot it lands in, whoever shares its batch and whenever it arrives.

Policy: requests wait in FIFO order; each step admits waiting requests into free slots (in
``slot_order``) while the step's token count -- one decode token per running request plus
the whole prompt of each admitted one -- stays within ``token_budget``.  Admission stops at
the first request that does not fit (no overtaking, so nothing starves); a prompt larger than
the whole budget is admitted as the only prompt of its step.  A finished request frees its
slot at the end of the step, and a waiting one may take it in the next.
"""
from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

from tpinv.engine.sampling import RequestId, SamplingParams, request_key

__all__ = ["FINISH_REASONS", "Request", "Result", "Scheduler", "RequestLine", "SequenceState", "read_requests_jsonl",
           "request_from_json", "validate_request"]

#: ``eos`` (the EOS token), ``stop`` (a stop string or stop token id), ``length`` (max_tokens or
#: the context is full), ``error`` (the request was rejected; see ``Result.error``).
FINISH_REASONS = ("eos", "stop", "length", "error")


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.

    ``prompt`` is a list of token ids, or a text (needs the engine's tokenizer).  ``stop``
    strings need a tokenizer too.  ``top_logprobs`` > 0 also returns the model's ``k`` largest
    log-probs (and their ids) at every generated position.
    """

    request_id: RequestId
    prompt: Union[Sequence[int], str]
    max_tokens: int = 16
    sampling: SamplingParams = SamplingParams()
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0


@dataclasses.dataclass
class Result:
    """What a request produced.

    ``logprobs [n]`` (fp32): the raw model log-prob of each generated token, ``log softmax``
    of the unmodified logits -- the same bits the training forward
    (:meth:`tpinv.models.Transformer.log_probs`) gives for that token.
    ``sampled_logprobs [n]`` (fp32): the log-prob under the distribution actually sampled from,
    after temperature, top-k and top-p (0.0 for greedy tokens).
    """

    request_id: RequestId
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor
    sampled_logprobs: torch.Tensor
    finish_reason: str
    text: Optional[str] = None
    error: Optional[str] = None
    top_logprobs: Optional[torch.Tensor] = None      # [n, k] fp32, descending
    top_token_ids: Optional[torch.Tensor] = None     # [n, k] int64

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; fp32 values as Python floats (exact, they round-trip to the same fp32)."""
        out = {"id": self.request_id, "prompt_ids": self.prompt_ids, "token_ids": self.token_ids,
               "logprobs": self.logprobs.tolist(), "sampled_logprobs": self.sampled_logprobs.tolist(),
               "finish_reason": self.finish_reason, "text": self.text, "error": self.error}
        if self.top_logprobs is not None:
            out["top_logprobs"] = self.top_logprobs.tolist()
            out["top_token_ids"] = self.top_token_ids.tolist()
        return out


#: JSON fields of a request line (``prompt`` is a text or a list of token ids).
JSON_FIELDS = ("id", "prompt", "prompt_ids", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
               "stop_token_ids", "ignore_eos", "top_logprobs")


def request_from_json(line: dict, index: int, defaults: Optional[dict] = None, where: Optional[str] = None) -> Request:
    """A :class:`Request` from one JSON object; ``defaults`` fill the fields it leaves out, and
    ``index`` is its ``id`` where it gives none.

    Raises ValueError naming ``where`` (default ``line {index}``) and an unknown field or a field
    of the wrong type; the values themselves are checked when the request is submitted (so a bad
    value becomes that request's error result).
    """
    where = where or f"line {index}"
    if not isinstance(line, dict):
        raise ValueError(f"{where}: expected a JSON object with fields {JSON_FIELDS}, got {type(line).__name__}")
    unknown = sorted(set(line) - set(JSON_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected some of {JSON_FIELDS}")
    if ("prompt" in line) == ("prompt_ids" in line):
        raise ValueError(f"{where}: expected exactly one of 'prompt' (text) and 'prompt_ids' (token ids)")
    _check_json_types(line, where)
    d = {**(defaults or {}), **line}
    if isinstance(d.get("stop"), str):
        d["stop"] = [d["stop"]]  # one stop string, as in the OpenAI API (not its characters)
    sampling = SamplingParams(d.get("temperature", 1.0), d.get("top_k", 0), d.get("top_p", 1.0), d.get("seed", 0))
    return Request(d.get("id", index), d["prompt"] if "prompt" in line else d["prompt_ids"],
                   max_tokens=d.get("max_tokens", 16), sampling=sampling, stop=tuple(d.get("stop", ())),
                   stop_token_ids=tuple(d.get("stop_token_ids", ())), ignore_eos=bool(d.get("ignore_eos", False)),
                   top_logprobs=d.get("top_logprobs", 0))


class RequestLine(NamedTuple):
    """One non-blank line of a request file: its line number (from 1), and its request or the
    message saying why it is not one."""

    number: int
    request: Optional[Request]
    error: Optional[str]


def read_requests_jsonl(path: str, defaults: Optional[dict] = None) -> list[RequestLine]:
    """The non-blank lines of a file of one JSON request a line, in order; a line that is not a
    request has its message (naming its line of the file) instead.  Request ``i`` (counted from 0
    over the non-blank lines) without an ``id`` has the id ``i``: a bad line keeps its place,
    and the lines after it their ids."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); expected one JSON object "
                         f"per line") from None
    out = []
    for i, (number, line) in enumerate(lines):
        where = f"line {number}"
        try:
            out.append(RequestLine(number, request_from_json(json.loads(line.strip()), i, defaults, where), None))
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            out.append(RequestLine(number, None, f"{where}: {e}" if isinstance(e, json.JSONDecodeError) else str(e)))
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: field -> (check, what it must be) for the fields of a JSON request line.
_JSON_TYPES = {
    "id": (lambda v: _is_int(v) or isinstance(v, str), "an int or a string"),
    "prompt": (lambda v: isinstance(v, str), "a string"),
    "prompt_ids": (lambda v: isinstance(v, list) and all(_is_int(t) for t in v), "a list of ints"),
    "max_tokens": (_is_int, "an int"),
    "temperature": (_is_number, "a number"),
    "top_k": (_is_int, "an int"),
    "top_p": (_is_number, "a number"),
    "seed": (_is_int, "an int"),
    "stop": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
             "a string or a list of strings"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(_is_int(t) for t in v), "a list of ints"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "top_logprobs": (_is_int, "an int"),
}


def _check_json_types(line: dict, where: str) -> None:
    for key, value in line.items():
        ok, what = _JSON_TYPES[key]
        if not ok(value):
            raise ValueError(f"{where}: field {key!r} is {json.dumps(value)}; expected {what}")


def error_result(request_id: Any, message: str) -> Result:
    empty = torch.zeros(0, dtype=torch.float32)
    return Result(request_id, [], [], empty, empty.clone(), "error", error=message)


def validate_request(request: Request, *, vocab_size: int, max_context: int, tokenizer=None) -> list[int]:
    """The prompt's token ids, or ValueError/TypeError saying what was expected."""
    if not isinstance(request, Request):
        raise TypeError(f"expected a tpinv.engine.Request, got {type(request).__name__}")
    request_key(request.request_id)  # int or str
    if isinstance(request.prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass token ids ('prompt_ids'), or give the engine a "
                             "tokenizer (a named config has none; launch/generate.py takes --tokenizer)")
        ids = tokenizer.encode(request.prompt)
    else:
        ids = list(request.prompt)
    if not ids:
        raise ValueError("empty prompt: expected at least one token")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is not an int in [0, vocab_size={vocab_size})")
    if len(ids) >= max_context:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {max_context} tokens "
                         f"(expected at most {max_context - 1}, leaving room for one generated token)")
    m = request.max_tokens
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"max_tokens={m!r}: expected an int >= 1")
    k = request.top_logprobs
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= vocab_size:
        raise ValueError(f"top_logprobs={k!r}: expected an int in [0, vocab_size={vocab_size}]")
    if not isinstance(request.sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(request.sampling).__name__}")
    request.sampling.validate()
    if isinstance(request.stop, str) or any(not isinstance(s, str) or not s for s in request.stop):
        raise ValueError(f"stop={request.stop!r}: expected a list of non-empty strings")
    if request.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer; use stop_token_ids or give the engine a tokenizer")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in request.stop_token_ids):
        raise ValueError(f"stop_token_ids={list(request.stop_token_ids)!r}: expected ints in [0, {vocab_size})")
    return ids


@dataclasses.dataclass(eq=False)
class SequenceState:
    """A request in flight: its slot, tokens so far and the positions held in the KV cache."""

    request: Request
    prompt_ids: list[int]
    handle: int = 0                  # the engine's id of this submission
    slot: int = -1
    cached: int = 0                  # positions [0, cached) of this request are in its cache slot
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    sampled_logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    top_token_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    text: Optional[str] = None
    error: Optional[str] = None      # why it ended with finish_reason "error"

    @property
    def length(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.tokens)

    @property
    def next_position(self) -> int:
        """Absolute position of the next token to be drawn."""
        return self.length


class Scheduler:
    """Slots ``0 .. max_batch-1`` of a KV cache, a FIFO of waiting requests and a per-step token budget."""

    def __init__(self, max_batch: int, *, token_budget: Optional[int] = None,
                 slot_order: Optional[Sequence[int]] = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r}: expected a positive int")
        if token_budget is not None and (isinstance(token_budget, bool) or not isinstance(token_budget, int)
                                         or token_budget < max_batch):
            raise ValueError(f"token_budget={token_budget!r}: expected None or an int >= max_batch={max_batch} "
                             f"(every running request decodes one token per step)")
        order = list(range(max_batch)) if slot_order is None else [int(s) for s in slot_order]
        if sorted(order) != list(range(max_batch)):
            raise ValueError(f"slot_order={list(slot_order)!r}: expected a permutation of range({max_batch})")
        self.max_batch, self.token_budget, self.slot_order = max_batch, token_budget, order
        self.waiting: collections.deque[SequenceState] = collections.deque()
        self.running: dict[int, SequenceState] = {}

    def add(self, state: SequenceState) -> None:
        self.waiting.append(state)

    def free_slots(self) -> list[int]:
        return [s for s in self.slot_order if s not in self.running]

    def admit(self) -> list[SequenceState]:
        """Move waiting requests into free slots for this step, within the token budget."""
        admitted: list[SequenceState] = []
        used = len(self.running)
        free = self.free_slots()
        while self.waiting and free:
            need = len(self.waiting[0].prompt_ids)
            over = self.token_budget is not None and used + need > self.token_budget
            if over and (admitted or need <= self.token_budget):
                break  # it fits a later step, once running requests leave
            state = self.waiting.popleft()
            state.slot = free.pop(0)
            self.running[state.slot] = state
            admitted.append(state)
            used += need
            if over:
                break  # a prompt larger than the whole budget runs as the only prompt of its step
        return admitted

    def release(self, state: SequenceState) -> None:
        """Free the slot of a finished request."""
        if self.running.get(state.slot) is not state:
            raise ValueError(f"request {state.request.request_id!r} does not hold slot {state.slot}")
        del self.running[state.slot]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
