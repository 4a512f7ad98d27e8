"""What the engine hands back: per-branch completion deltas and one usage record per request."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass
class SampleResult:
    """One sampled token (the sampler's result; torch-free so the services can carry it without the engine)."""
    token_id: int
    logprob: float | None  # chosen token's logprob in params.logprobs_mode; None if not requested
    top_logprobs: list[tuple[int, float]] | None  # N alternatives sorted by (-logprob, id)


class Prefix(Sequence):
    """The first `end` items of an append-only list from `start` on, read when asked. A running sequence's output
    carries its cumulative token ids (and logprobs) at every step; copying them there cost O(length) a sequence
    a step (8 us at 1,000 tokens; docs/engine.md, "Long answers"), for consumers that mostly read only the new
    tokens. A sequence's committed tokens and logprobs are only ever
    appended to (speculative candidates past them are appended and removed, never the committed ones), so the
    prefix stays what it was when the output was made."""

    __slots__ = ("_src", "_start", "_end")

    def __init__(self, src: list, start: int, end: int):
        self._src, self._start, self._end = src, start, end

    def __len__(self) -> int:
        return self._end - self._start

    def __getitem__(self, i):
        r = range(self._start, self._end)[i]  # bounds and negative indices as a list's
        if isinstance(i, int):
            return self._src[r]
        return self._src[r.start:r.stop] if r.step == 1 else [self._src[j] for j in r]

    def __iter__(self):
        return iter(self._src[self._start:self._end])

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, Prefix)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._src[self._start:self._end])


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """A request's lifecycle timestamps (Unix seconds; None = not reached). Frozen: the engine replaces the whole
    value at each of its few transitions, so every output can carry the current one without a copy."""
    arrival: float
    queued: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def scheduled_at(self, t: float) -> RequestTimes:
        return self if self.first_scheduled is not None else replace(self, first_scheduled=t)

    def first_token_at(self, t: float) -> RequestTimes:
        return self if self.first_token is not None else replace(self, first_token=t)

    def finished_at(self, t: float) -> RequestTimes:
        return replace(self, finished=t)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # cumulative
    token_ids: Sequence[int]  # cumulative generated tokens (a list once finished, a `Prefix` before)
    new_text: str  # since the previous output of this request
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "prefill" | "abort" | None while running
    cumulative_logprob: float = 0.0
    logprobs: Sequence | None = None  # per generated token: SampleResult-like (token_id, logprob, top_logprobs)


@dataclass
class FirstToken:
    """One branch's first token, sampled where the prompt was prefilled (the prefill worker): the decode side
    continues the branch from it. `cumulative_logprob` is its raw log-prob (best_of ranks branches by the sum);
    `logprobs` its SampleResult-like entry when the request asked for logprobs."""
    token_id: int
    cumulative_logprob: float = 0.0
    logprobs: object | None = None


@dataclass(slots=True)  # one a request a step: slots make building and reading it cheaper
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    state: str  # the request's state name (terminal state once finished)
    num_cached_tokens: int = 0
    times: RequestTimes | None = None
    prompt_logprobs: list | None = None
    error: str | None = None
    num_generated_tokens: int = 0  # sampled so far, every branch (best_of: the ones not returned too)
    # Q16 decode accounting, every branch (spec_decode/decoder.py): verified positions, accepted candidates, KV kept
    num_verified_tokens: int = 0
    num_accepted_tokens: int = 0
    num_kv_growth_tokens: int = 0


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One request's accounting when it ends (the engine keeps the latest and logs each one as JSON on the
    `pdserve.usage` logger). generated = sampled, every branch; emitted = shown to the client; committed = the
    returned branches' tokens. verified / accepted / kv_growth: Q16 decode accounting (spec_decode/decoder.py)."""
    request_id: str
    namespace: str
    state: str  # the terminal state's name
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    emitted_tokens: int
    committed_tokens: int
    finish_reasons: tuple[str | None, ...]
    num_preemptions: int
    verified_tokens: int
    accepted_tokens: int
    kv_growth_tokens: int
    deadline: float | None
    times: RequestTimes
