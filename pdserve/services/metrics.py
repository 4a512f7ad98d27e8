"""Prometheus metrics, all prefixed `pdserve_`. Every process imports this module, so each exposes the same
names; a metric a process never touches stays at zero. Latency definitions follow spec §2.1 with the gateway
as the system boundary for TTFT/ITL/TPOT/E2E (arrival = HTTP request received, emit = SSE chunk written)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

TTFT = Histogram("pdserve_ttft_seconds", "Time to first token (arrival -> first emit)", ["mode"], buckets=_LAT)
ITL = Histogram("pdserve_itl_seconds", "Inter-token latency (emit j - emit j-1)", ["mode"], buckets=_FAST)
TPOT = Histogram("pdserve_tpot_seconds", "(last emit - first emit) / (N_out - 1), N_out >= 2", ["mode"],
                 buckets=_FAST)
E2E = Histogram("pdserve_e2e_seconds", "Arrival -> last emit", ["mode"], buckets=_LAT)
QUEUE_TIME = Histogram("pdserve_queue_time_seconds", "Engine arrival -> first scheduled", ["role"], buckets=_LAT)
PREFILL_TIME = Histogram("pdserve_prefill_time_seconds", "First scheduled -> first token", ["role"], buckets=_LAT)
KV_TRANSFER_SECONDS = Histogram("pdserve_kv_transfer_seconds", "One batched NIXL READ of a request's blocks",
                                buckets=_FAST)
KV_TRANSFER_BYTES = Counter("pdserve_kv_transfer_bytes_total", "Bytes pulled over NIXL")
KV_TRANSFER_FAILURES = Counter("pdserve_kv_transfer_failures_total", "Failed or timed-out KV pulls", ["reason"])
KV_HANDSHAKES = Counter("pdserve_kv_handshakes_total", "KV handshakes between a decode and a prefill worker "
                        "(side: initiated on the decode worker, served on the prefill worker)", ["side"])
KV_BLOCKS_IN_USE = Gauge("pdserve_kv_blocks_in_use", "KV blocks allocated (incl. pinned for transfer)")
KV_BLOCKS_TOTAL = Gauge("pdserve_kv_blocks_total", "KV blocks in the pool")
KV_BLOCKS_PINNED = Gauge("pdserve_kv_blocks_pinned", "Prefill-side blocks pinned under a lease")
PREFIX_HIT_RATIO = Gauge("pdserve_prefix_hit_ratio", "Engine prefix-cache hit ratio")
NUM_RUNNING = Gauge("pdserve_num_running", "Requests running in the engine")
NUM_WAITING = Gauge("pdserve_num_waiting", "Requests waiting in the engine")
LEASES_EXPIRED = Counter("pdserve_kv_leases_expired_total", "Pinned KV freed by lease expiry (nobody pulled)")
TERMINAL = Counter("pdserve_requests_terminal_total", "Requests reaching a terminal state", ["state"])
REJECTIONS = Counter("pdserve_rejections_total", "Requests rejected before running", ["reason"])
ROUTED = Counter("pdserve_routed_total", "Router placements", ["mode"])
# router (docs/routing.md)
ROUTE_DECISIONS = Counter("pdserve_route_decisions_total", "Router decisions by placement mode and reason",
                          ["mode", "reason"])
ROUTE_DEGRADED = Counter("pdserve_route_degraded_total",
                         "Requests prefilled locally on a decode worker because the prefill pool was down/failing",
                         ["reason"])
ROUTE_PREDICTED_TTFT = Histogram("pdserve_route_predicted_ttft_seconds", "The router's TTFT prediction",
                                 buckets=_LAT)
ROUTE_PROMPT_TOKENS = Counter("pdserve_route_prompt_tokens_total", "Prompt tokens routed")
ROUTE_CACHED_TOKENS = Counter("pdserve_route_cached_tokens_total",
                              "Prompt tokens the prefix index predicted cached where the request went "
                              "(ratio to pdserve_route_prompt_tokens_total = routed prefix hit ratio)")
PREFIX_INDEX_BLOCKS = Gauge("pdserve_prefix_index_blocks", "Distinct (namespace, block) keys in the router index")
PREFIX_INDEX_EVENTS = Counter("pdserve_prefix_index_events_total", "KV events applied to the router index")
KV_EVENTS_PUBLISHED = Counter("pdserve_kv_events_published_total", "KV events a worker published", ["kind"])

# ---- request lifecycle: admission, states, usage (docs/admission.md) -----------------------------------------
STATE_GAUGE = Gauge("pdserve_requests_in_state", "Live requests per state: engine sequences on workers; "
                    "QUEUED (admission queue) and DEGRADED on the gateway", ["state"])
INGRESS_DEGRADED = Counter("pdserve_ingress_degraded_total", "Ingress decisions made without Redis (local bucket)")
ADMISSION_DEGRADED = Counter("pdserve_admission_degraded_total", "Reservation calls served by the local ledger")
RESERVED_BLOCKS = Gauge("pdserve_admission_reserved_blocks", "KV blocks reserved (all gateway replicas)")
RESERVED_REQUESTS = Gauge("pdserve_admission_reserved_requests", "Requests holding a reservation (all replicas)")
ADMISSION_WAIT = Histogram("pdserve_admission_wait_seconds", "Time queued for a reservation", buckets=_LAT)
DEGRADED_TOTAL = Counter("pdserve_degraded_total", "Requests admitted with a smaller n than asked")
USAGE_RECORDS = Counter("pdserve_usage_records_total", "Billing records (one per client request)",
                        ["tenant", "state"])
USAGE_TOKENS = Counter("pdserve_usage_tokens_total", "Billed token counts per tenant",
                       ["tenant", "kind"])  # kind: prompt | generated | emitted | committed


class _StateEntries:
    """`pdserve_request_state_entries_total{state}`: how often sequences entered each of the 14 states in this
    process (transient states such as RUNNABLE / RESUMED last less than a tick, so only a counter shows them)."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily
        from pdserve.engine.request_state import ENTERED
        m = CounterMetricFamily("pdserve_request_state_entries", "Sequences entering each state", labels=["state"])
        for state, n in ENTERED.items():
            m.add_metric([state], n)
        yield m


def _register_state_entries() -> None:
    from prometheus_client import REGISTRY
    try:
        REGISTRY.register(_StateEntries())
    except ValueError:  # already registered (module reloaded)
        pass


_register_state_entries()


def set_state_gauges(counts: dict[str, int], states: list[str]) -> None:
    for s in states:
        STATE_GAUGE.labels(s).set(counts.get(s, 0))
REJECT_LATENCY = Histogram("pdserve_rejection_latency_seconds", "Gateway: arrival -> rejection response written "
                           "(ingress or admission)", buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))


def observe_engine_times(role: str, out) -> None:
    """Queue and prefill time of a request from its engine output's timestamps (a worker's first output)."""
    m = (out.metrics or {}) if out is not None else {}
    a, s, f = m.get("arrival_time"), m.get("first_scheduled_time"), m.get("first_token_time")
    if a and s:
        QUEUE_TIME.labels(role).observe(max(0.0, s - a))
    if s and f:
        PREFILL_TIME.labels(role).observe(max(0.0, f - s))
