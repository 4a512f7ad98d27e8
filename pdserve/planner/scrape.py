"""Prometheus text from the gateway and the workers -> a `Snapshot` of counters -> one interval's `Observation`.

Families read (docs/metrics.md): gateway `pdserve_requests_terminal_total` (client requests done),
`pdserve_http_requests_in_flight` (`/v1/...` endpoints: arrived, not done), `pdserve_request_prompt_tokens` and
`pdserve_request_output_tokens` (per-request lengths), `pdserve_ttft_seconds` / `pdserve_tpot_seconds`
(percentiles), `pdserve_gateway_requests_in_state{state="QUEUED"}` (admission queue); workers
`pdserve_num_waiting` (engine queues) and `pdserve_prefix_cache_{hits,queries}_total` (prefix-hit ratio). Every
series is summed over its labels (modes, workers). Arrivals in an interval = requests finished + the change of
requests in flight, so a step up shows at once rather than when the new requests finish.
"""
from __future__ import annotations

import logging
import math
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("pdserve.planner")


@dataclass
class Snapshot:
    t: float = 0.0                      # monotonic seconds at the scrape
    finished: float = 0.0               # client requests in a terminal state (counter)
    in_flight: float = 0.0              # client requests being served (gauge)
    prompt_sum: float = 0.0
    prompt_count: float = 0.0
    output_sum: float = 0.0
    output_count: float = 0.0
    ttft: dict[float, float] = field(default_factory=dict)   # cumulative buckets: le -> count
    tpot: dict[float, float] = field(default_factory=dict)
    queued: float = 0.0                 # gateway admission queue + engine waiting queues (gauges)
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0


@dataclass(frozen=True)
class Observation:
    """One interval's measured load and latency (None: no request in the interval to measure it on)."""
    window_s: float
    rate: float                 # arrivals / s
    requests: float             # requests finished in the window
    prompt_mean: float | None
    output_mean: float | None
    prefix_hit: float           # prompt tokens found in a prefix cache / looked up (0 when unknown)
    ttft_p90: float | None
    tpot_p90: float | None
    queued: float


def _v1(labels: dict) -> bool:
    return labels.get("endpoint", "").startswith("/v1/")  # the API's requests, not the gateway's own pages


def _queued(labels: dict) -> bool:
    return labels.get("state") == "QUEUED"


# sample name -> (the Snapshot field it adds to, which labels count: None = all); one line per family read
SUMS: dict[str, tuple[str, Callable[[dict], bool] | None]] = {
    "pdserve_requests_terminal_total": ("finished", None),
    "pdserve_http_requests_in_flight": ("in_flight", _v1),
    "pdserve_request_prompt_tokens_sum": ("prompt_sum", None),
    "pdserve_request_prompt_tokens_count": ("prompt_count", None),
    "pdserve_request_output_tokens_sum": ("output_sum", None),
    "pdserve_request_output_tokens_count": ("output_count", None),
    "pdserve_gateway_requests_in_state": ("queued", _queued),
    "pdserve_num_waiting": ("queued", None),  # the gateway's admission queue and the engines' add up
    "pdserve_prefix_cache_hits_total": ("prefix_hits", None),
    "pdserve_prefix_cache_queries_total": ("prefix_queries", None),
}
# histogram bucket samples -> the Snapshot field holding their cumulative counts by `le`
BUCKETS: dict[str, str] = {
    "pdserve_ttft_seconds_bucket": "ttft",
    "pdserve_tpot_seconds_bucket": "tpot",
}


def parse(text: str, snap: Snapshot) -> None:
    """Add the series of one /metrics page to `snap` (several pages sum: gateway replicas, workers)."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            n, lb, v = s.name, s.labels, s.value
            if n in BUCKETS:
                h = getattr(snap, BUCKETS[n])
                le = float(lb["le"])
                h[le] = h.get(le, 0.0) + v
            elif n in SUMS:
                name, keep = SUMS[n]
                if keep is None or keep(lb):
                    setattr(snap, name, getattr(snap, name) + v)


def fetch(urls: list[str], timeout_s: float = 3.0, bearer: str | None = None) -> Snapshot:
    """Scrape every URL; one that does not answer is skipped with a warning (a worker may be stopping). `bearer`:
    sent as `Authorization: Bearer`, for a gateway whose /metrics asks for a key (the local planner's internal
    token)."""
    snap = Snapshot(t=time.monotonic())
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    for url in urls:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as r:
                parse(r.read().decode(), snap)
        except Exception as e:  # noqa: BLE001 - a missing page lowers what we see, it does not stop the loop
            log.warning("planner: scrape %s failed: %s", url, e)
    return snap


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over the bucket increments between two scrapes: linear inside the bucket
    holding the q-th observation; the +Inf bucket answers the largest finite bound. None: nothing observed."""
    les = sorted(after)
    inc = [after[le] - before.get(le, 0.0) for le in les]
    if not les or inc[-1] <= 0:
        return None
    rank = q * inc[-1]
    lo, prev = 0.0, 0.0
    for le, c in zip(les, inc):
        if c >= rank:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * ((rank - prev) / (c - prev) if c > prev else 1.0)
        lo, prev = le, c
    return lo


def observe(prev: Snapshot, cur: Snapshot) -> Observation:
    dt = max(cur.t - prev.t, 1e-6)
    done = max(0.0, cur.finished - prev.finished)
    arrived = max(0.0, done + cur.in_flight - prev.in_flight)
    pc, oc = cur.prompt_count - prev.prompt_count, cur.output_count - prev.output_count
    q = cur.prefix_queries - prev.prefix_queries
    return Observation(
        window_s=dt, rate=arrived / dt, requests=done,
        prompt_mean=(cur.prompt_sum - prev.prompt_sum) / pc if pc > 0 else None,
        output_mean=(cur.output_sum - prev.output_sum) / oc if oc > 0 else None,
        prefix_hit=min(1.0, max(0.0, (cur.prefix_hits - prev.prefix_hits) / q)) if q > 0 else 0.0,
        ttft_p90=quantile(0.9, prev.ttft, cur.ttft), tpot_p90=quantile(0.9, prev.tpot, cur.tpot),
        queued=cur.queued)
