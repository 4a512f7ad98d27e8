"""What the engine hands back: per-branch completion deltas and one usage record per request."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SampleResult:
    """One sampled token (the sampler's result; torch-free so the services can carry it without the engine)."""
    token_id: int
    logprob: float | None  # chosen token's logprob in params.logprobs_mode; None if not requested
    top_logprobs: list[tuple[int, float]] | None  # N alternatives sorted by (-logprob, id)


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative
    token_ids: list[int]  # cumulative generated tokens
    new_text: str  # since the previous output of this request
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "prefill" | "abort" | None while running
    cumulative_logprob: float = 0.0
    logprobs: list | None = None  # per generated token: SampleResult-like (token_id, logprob, top_logprobs)


@dataclass
class FirstToken:
    """One branch's first token, sampled where the prompt was prefilled (the prefill worker): the decode side
    continues the branch from it. `cumulative_logprob` is its raw log-prob (best_of ranks branches by the sum);
    `logprobs` its SampleResult-like entry when the request asked for logprobs."""
    token_id: int
    cumulative_logprob: float = 0.0
    logprobs: object | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    state: str  # the request's state name (terminal state once finished)
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list | None = None
    error: str | None = None
    num_generated_tokens: int = 0  # sampled so far, every branch (best_of: the ones not returned too)
    # Q16 decode accounting, every branch (spec_decode/decoder.py): verified positions, accepted candidates, KV kept
    num_verified_tokens: int = 0
    num_accepted_tokens: int = 0
    num_kv_growth_tokens: int = 0
