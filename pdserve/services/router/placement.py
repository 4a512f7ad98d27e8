"""The placement interface: what a placement policy is given (`RouteInput`, the live `WorkerRecord`s), what it
answers (`Placement`), and what it is built from (`PolicyContext`).

A policy is anything with `place(workers, *, req) -> Placement` that raises `NoWorkers` when no worker can take
the request. The router (server.py) and the simulator (sim/placer.py) both build theirs by name through
policy_registry.py and call nothing else on it.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from pdserve.services.registry import WorkerRecord
from pdserve.services.router.prefix_index import PrefixIndex
from pdserve.services.router.spread import RouteWeights, Terms


class NoWorkers(RuntimeError):
    """No live worker can take the request (maps to HTTP 503 / gRPC UNAVAILABLE)."""


@dataclass
class RouteInput:
    request_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0  # used when the token ids are not given (no prefix lookup then)
    namespace: str = ""
    max_tokens: int = 0
    exclude: set[str] = field(default_factory=set)
    prefer: str = ""  # "" | "colocated" | "disagg" | "local" (a both or decode worker, never a pair)

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_token_ids) or self.num_prompt_tokens


@dataclass
class Placement:
    mode: str  # disagg | colocated (the gateway's two request paths)
    prefill: WorkerRecord | None = None
    decode: WorkerRecord | None = None
    both: WorkerRecord | None = None
    reason: str = ""
    cached_tokens: int = 0
    decode_cached_tokens: int = 0  # disagg: the decode worker's device-tier hit (it pulls only the rest)
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    alternative_s: float = 0.0  # best cost of the kind not chosen (0: none)
    n_candidates: int = 0
    terms: Terms = field(default_factory=Terms)  # the chosen candidate's spread.py terms

    def header(self) -> str:
        """The `x-pdserve-route` debug header."""
        ws = f"prefill={self.prefill.worker_id};decode={self.decode.worker_id}" if self.mode == "disagg" \
            else f"worker={self.both.worker_id}"
        return (f"mode={self.mode};reason={self.reason};{ws};cached_tokens={self.cached_tokens};"
                f"ttft_s={self.ttft_s:.4f};e2e_s={self.e2e_s:.4f};alt_s={self.alternative_s:.4f};"
                f"candidates={self.n_candidates};zone={self.terms.zone};fd_s={self.terms.fd_s:.4f};"
                f"price_s={self.terms.price_s:.4f};fair_s={self.terms.fair_s:.4f}"
                + (f";decode_cached_tokens={self.decode_cached_tokens}" if self.mode == "disagg" else ""))


class PlacementPolicy(Protocol):
    def place(self, workers: list[WorkerRecord], *, req: RouteInput) -> Placement: ...


@dataclass
class PolicyContext:
    """Everything a policy may be built from; each takes what it needs. The router's clock is wall time, the
    simulator's virtual time (reports and in-flight placements age by it)."""
    mode: str = "auto"  # the cache-aware policy's auto | disagg | colocated
    index: PrefixIndex | None = None  # the prefix index (router: from Redis; simulator: from the replicas' events)
    weights: RouteWeights | None = None
    local_stall_steps: float | None = None  # the cache-aware policy's stall cap (cost.py); None: its default
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.time
    # The simulator's replicas by worker id: exact cache contents and queues no deployment can know. None in the
    # router; a policy that needs them is registered `sim_only`.
    replicas: Mapping[str, object] | None = None
