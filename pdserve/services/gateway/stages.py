"""Per-request stage timestamps for the client: `usage.stage_times` (definitions in docs/services.md).

One `StageTrace` per engine sub-request. The dispatcher fills in the route time and the workers' `StageTimes`
(the prefill worker's from `PrefillResponse.times`, the decode or `both` worker's from the stream); the
request handler (handler.py) adds the gateway's emit times. `stage_times` turns a trace plus the request's
record into the JSON object: absolute timestamps (Unix seconds, `time.time()` in each process: comparable
across processes on one host or NTP-synced hosts) and consecutive durations that partition gateway E2E.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

# consecutive stages from gateway arrival to the gateway's last emit (their sum is E2E by construction; the
# timestamps' order across processes is what a test can check). handoff and kv_transfer are part of the sum only
# when the first token waited for the KV transfer (`kv_on_ttft_path`); otherwise they overlap `decode`.
DURATIONS = ("admission", "route", "dispatch", "queue", "prefill", "handoff", "kv_transfer", "first_emit", "decode")


def _nz(x: float) -> float | None:
    return x if x else None  # proto doubles: 0 = unknown


@dataclass
class EngineTimes:
    """One worker engine's timestamps for the sub-request, merged from its `StageTimes` messages (None = not
    reported). The KV pull's are a decode worker's only."""
    arrival: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    kv_transfer_start: float | None = None
    kv_transfer_end: float | None = None
    kv_bytes: int | None = None  # the KV bytes the decode worker pulled (its pickup's first message)

    def merge(self, times) -> None:
        # later messages repeat the engine's times and add `finished`; the KV pull times are on the first only
        for f in _ENGINE_FIELDS:
            v = _nz(getattr(times, f))
            if v is not None:
                setattr(self, f, v)

    @property
    def reported(self) -> bool:
        return any(getattr(self, f) is not None for f in _ENGINE_FIELDS)


_ENGINE_FIELDS = tuple(f.name for f in fields(EngineTimes))


@dataclass
class StageTrace:
    routed: float | None = None
    # the engine that ran the prefill (prefill worker in disagg, `both` worker in colocated)
    prefill: EngineTimes = field(default_factory=EngineTimes)
    # disagg only: the decode worker's engine + its KV pull
    decode: EngineTimes = field(default_factory=EngineTimes)
    disagg: bool = False
    first_emit: float | None = None
    last_emit: float | None = None
    # mid-stream migrations (gateway/migration.py): how often the sub-request moved, and the tokens the new
    # workers prefilled again (prompt + tokens already sent, less their prefix-cache hits): the usage record's
    migrations: int = 0
    recomputed_tokens: int = 0

    def on_route(self, mode: str) -> None:
        # a reroute (worker unreachable before any token) overwrites: the stages describe the attempt that served
        self.routed = time.time()
        self.disagg = mode == "disagg"
        self.prefill, self.decode = EngineTimes(), EngineTimes()

    def on_prefill(self, times) -> None:
        self.prefill.merge(times)

    def on_stream(self, times) -> None:
        (self.decode if self.disagg else self.prefill).merge(times)

    def on_emit(self, now: float) -> None:
        if self.first_emit is None:
            self.first_emit = now
        self.last_emit = now


def stage_times(arrival: float, admitted: float | None, t: StageTrace, index: int = 0, count: int = 1) -> dict:
    """The `usage.stage_times` object for one sub-request (index of count). Missing stages are null."""
    p, d = t.prefill, t.decode
    admitted = admitted if admitted is not None else arrival  # no admission control: admitted on arrival
    kv_end = d.kv_transfer_end
    ts = {
        "arrival": arrival, "admitted": admitted, "routed": t.routed,
        "worker_arrival": p.arrival, "first_scheduled": p.first_scheduled, "first_token": p.first_token,
        "decode_arrival": d.arrival, "kv_transfer_start": d.kv_transfer_start, "kv_transfer_end": kv_end,
        "worker_finished": (d if d.reported else p).finished,
        "first_emit": t.first_emit, "last_emit": t.last_emit,
    }

    def span(a: float | None, b: float | None) -> float | None:
        return b - a if a is not None and b is not None else None

    # Disagg normally emits the first token from the Prefill reply, before the KV moves: then the decode side's
    # pickup (handoff, kv_transfer) runs behind the first emit and overlaps `decode`. Only a first token that came
    # through the decode worker (after its READ) has them on the TTFT path, inside the partition.
    late = kv_end is not None and t.first_emit is not None and t.first_emit >= kv_end
    ready = kv_end if late else ts["first_token"]
    dur = {
        "admission": span(arrival, admitted), "route": span(admitted, t.routed),
        "dispatch": span(t.routed, ts["worker_arrival"]),
        "queue": span(ts["worker_arrival"], ts["first_scheduled"]),
        "prefill": span(ts["first_scheduled"], ts["first_token"]),
        "handoff": span(ts["first_token"], ts["kv_transfer_start"]) if kv_end is not None else 0.0,
        "kv_transfer": span(ts["kv_transfer_start"], kv_end) if kv_end is not None else 0.0,
        "first_emit": span(ready, t.first_emit), "decode": span(t.first_emit, t.last_emit),
        "ttft": span(arrival, t.first_emit), "e2e": span(arrival, t.last_emit),
    }
    return {**ts, "durations": dur, "mode": "disagg" if t.disagg else "colocated",
            "kv_on_ttft_path": late,
            "sub_request": index, "sub_requests": count}


@dataclass(frozen=True)
class KvMoved:
    """The KV a request moved between workers, over all its sub-requests' pulls (the attempts that served them)."""
    nbytes: int
    seconds: float
    pulls: int

    def usage(self) -> dict:
        return {"bytes": self.nbytes, "seconds": round(self.seconds, 6), "pulls": self.pulls}

    def headers(self) -> dict[str, str]:
        return {"x-pdserve-kv-bytes": str(self.nbytes), "x-pdserve-kv-transfer-ms": f"{self.seconds * 1e3:.3f}"}


def kv_moved(traces: list[StageTrace]) -> KvMoved | None:
    """None when no sub-request was served disaggregated (nothing was pulled)."""
    done = [t.decode for t in traces if t.disagg and t.decode.kv_transfer_end is not None]
    if not done:
        return None
    return KvMoved(sum(d.kv_bytes or 0 for d in done),
                   sum(d.kv_transfer_end - (d.kv_transfer_start or d.kv_transfer_end) for d in done), len(done))


def pick(traces: list[StageTrace]) -> int:
    """With n > 1 / several prompts, report the sub-request that emitted last: it bounds the response's E2E."""
    best, best_t = 0, float("-inf")
    for i, t in enumerate(traces):
        if t.last_emit is not None and t.last_emit > best_t:
            best, best_t = i, t.last_emit
    return best


def emit_spans(arrival: float, admitted: float | None, traces: list[StageTrace]) -> None:
    """The gateway's stage spans (tracing on): each sub-request's partition as child spans of the request's."""
    from pdserve.services import tracing
    for i, t in enumerate(traces):
        tracing.gateway_stage_spans(stage_times(arrival, admitted, t, i, len(traces)))
