"""The gateway's request and event types: what a front door hands the handler, and what the handler's one consumer
of the upstream stream yields back. Front doors build a `GenerateCall` from their own wire format (an OpenAI JSON
body, a gRPC `GenerateRequest`) and render `Delta`s and the final `ActiveRequest` in it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.gateway.dispatch import SubRequest
from pdserve.services.gateway.lifecycle import RequestRecord
from pdserve.services.gateway.stages import StageTrace
from pdserve.services.gateway.timing import Timing
from pdserve.services.pb import common_pb2

FINISH_REASONS = {"stop": "stop", "length": "length"}  # engine -> OpenAI; anything else ends as "stop"


@dataclass
class GenerateCall:
    """One client request, parsed and validated, whichever front door it came through."""
    id_prefix: str  # "cmpl", "chatcmpl", "grpc"
    prompts: list[list[int]]
    params: SamplingParams
    client_label: str | None = None  # the caller's own id (gRPC), only echoed back: never a key (handler.start)
    timeout_s: float | None = None  # None: the server's default; capped by the tenant / server maximum
    allow_degrade: bool = True  # admission may lower n instead of refusing
    streamed: bool = False  # tokens reach the client as they come (counted as emitted at each delta)
    debug_route: bool = False  # `x-pdserve-debug: route`, for a tenant allowed to see it
    stage_times: bool = False  # asked for `usage.stage_times` (honoured for a tenant allowed to see it)
    prompt_only: bool = False  # echo with max_tokens 0: the sampled token is not part of the answer
    priority: int | None = None  # the body's `priority`: may only lower the tenant's urgency

    def priority_for(self, tenant_priority: int) -> int:
        """The engine priority (lower is more urgent): a request may ask to be less urgent than its API key's
        class, never more."""
        return tenant_priority if self.priority is None else max(self.priority, tenant_priority)


@dataclass
class Degraded:
    n_requested: int
    n_granted: int

    def to_json(self) -> dict:
        return {"n_requested": self.n_requested, "n_granted": self.n_granted}


@dataclass
class Delta:
    """One upstream message, after the handler counted it: `sub` is the sub-request it came from, `ntok` the new
    tokens it carries (its outputs' choice indexes are already the response's)."""
    sub: int
    msg: common_pb2.GenerateResponse
    ntok: int


@dataclass
class ActiveRequest:
    """Everything the handler knows about one admitted, dispatched request."""
    rid: str
    created: int
    call: GenerateCall
    rec: RequestRecord
    subs: list[SubRequest]
    traces: list[StageTrace]
    timing: Timing
    upstream: AsyncIterator[tuple[int, common_pb2.GenerateResponse]]
    first: tuple[int, common_pb2.GenerateResponse] | None = None  # pulled before answering: errors come first
    degraded: Degraded | None = None
    routes: list[str] = field(default_factory=list)  # the router's decisions (x-pdserve-route)
    headers: dict[str, str] = field(default_factory=dict)  # response headers the handler decided
    completion_tokens: int = 0  # tokens in the answer (prompt_only: none)
    tokens_per_choice: list[int] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    prompt_logprobs: list[list] = field(default_factory=list)  # per choice: TokenLogprob of prompt tokens 1..

    # The counts billing reads are the record's (lifecycle.RequestRecord): one owner, no copies to keep in step.
    @property
    def generated_tokens(self) -> int:
        """Tokens the workers sampled (best_of > n: also the branches not returned)."""
        return self.rec.generated

    @generated_tokens.setter
    def generated_tokens(self, n: int) -> None:
        self.rec.generated = n

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the workers found in their prefix caches."""
        return self.rec.cached_tokens

    @cached_tokens.setter
    def cached_tokens(self, n: int) -> None:
        self.rec.cached_tokens = n

    @property
    def n_choices(self) -> int:
        return sum(s.n_choices for s in self.subs)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.call.prompts)
