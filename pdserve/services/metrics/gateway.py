"""The gateway's families. Latency definitions follow spec §2.1 with the gateway as the system boundary for
TTFT/ITL/TPOT/E2E (arrival = HTTP request received, emit = SSE chunk written). The request counts here are of
client requests (one per HTTP/gRPC request, whatever it fans out to); workers count engine requests under their
own names."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.services.metrics.common import FAST, LAT, REJECTIONS, TOKENS  # noqa: F401 - REJECTIONS: app.py

GATEWAY = CollectorRegistry(auto_describe=True)

TTFT = Histogram("pdserve_ttft_seconds", "Time to first token (arrival -> first emit)", ["mode"], buckets=LAT,
                 registry=GATEWAY)
ITL = Histogram("pdserve_itl_seconds", "Inter-token latency (emit j - emit j-1)", ["mode"], buckets=FAST,
                registry=GATEWAY)
TPOT = Histogram("pdserve_tpot_seconds", "(last emit - first emit) / (N_out - 1), N_out >= 2", ["mode"],
                 buckets=FAST, registry=GATEWAY)
E2E = Histogram("pdserve_e2e_seconds", "Arrival -> last emit", ["mode"], buckets=LAT, registry=GATEWAY)

# ---- terminal path (lifecycle.finish): one observation per client request ------------------------------------
TERMINAL = Counter("pdserve_requests_terminal_total", "Client requests reaching a terminal state", ["state"],
                   registry=GATEWAY)
REJECT_LATENCY = Histogram("pdserve_rejection_latency_seconds", "Gateway: arrival -> rejection response written "
                           "(ingress or admission)", buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
                           registry=GATEWAY)
PROMPT_TOKENS = Counter("pdserve_prompt_tokens_total", "Prompt tokens of client requests that ran (not rejected)",
                        registry=GATEWAY)
GENERATION_TOKENS = Counter("pdserve_generation_tokens_total", "Tokens the workers generated for client requests",
                            registry=GATEWAY)
REQUEST_PROMPT_TOKENS = Histogram("pdserve_request_prompt_tokens", "Prompt length per client request that ran "
                                  "(tokens, all prompts of the request)", buckets=TOKENS, registry=GATEWAY)
REQUEST_OUTPUT_TOKENS = Histogram("pdserve_request_output_tokens", "Generated length per client request that ran "
                                  "(tokens, all choices)", buckets=TOKENS, registry=GATEWAY)
MIGRATIONS = Counter("pdserve_migrations_total", "Sub-requests moved to another worker after theirs failed them "
                     "(docs/reliability.md, Mid-stream migration), by reason: unavailable (stream broke), "
                     "worker_lost (silent and out of the registry), kv_transfer (the prompt's KV could not be pulled), "
                     "handoff (a worker switching role handed the stream on)",
                     ["reason"], registry=GATEWAY)
REQUESTS_BY_PATH = Counter("pdserve_requests_by_path_total", "Client (sub-)requests by the path that served them: "
                           "disagg, local (prefilled where it decodes, by the router's choice) or fallback "
                           "(disaggregation wanted and impossible), with the router's reason (gateway/path.py)",
                           ["path", "reason"], registry=GATEWAY)
CLIENT_DISCONNECTS = Counter("pdserve_client_disconnects_total", "Client requests ended because the client went "
                             "away before the answer was complete", registry=GATEWAY)

# ---- HTTP (http_metrics.py middleware): every route, including rejections before any request record --------
HTTP_REQUESTS = Counter("pdserve_http_requests_total", "HTTP responses by route and status code",
                        ["endpoint", "status"], registry=GATEWAY)
HTTP_IN_FLIGHT = Gauge("pdserve_http_requests_in_flight", "HTTP requests being served (streams until their end)",
                       ["endpoint"], registry=GATEWAY)

# ---- admission (docs/admission.md) ---------------------------------------------------------------------------
STATE_GAUGE = Gauge("pdserve_gateway_requests_in_state", "Client requests in the admission queue (QUEUED) or "
                    "running with a lowered n (DEGRADED)", ["state"], registry=GATEWAY)
INGRESS_DEGRADED = Counter("pdserve_ingress_degraded_total", "Ingress decisions made without Redis (local bucket)",
                           registry=GATEWAY)
ADMISSION_DEGRADED = Counter("pdserve_admission_degraded_total", "Reservation calls served by the local ledger",
                             registry=GATEWAY)
RESERVED_BLOCKS = Gauge("pdserve_admission_reserved_blocks", "KV blocks reserved (all gateway replicas)",
                        registry=GATEWAY)
RESERVED_REQUESTS = Gauge("pdserve_admission_reserved_requests", "Requests holding a reservation (all replicas)",
                          registry=GATEWAY)
CALIBRATION = Gauge("pdserve_admission_calibration_factor", "Measured / estimated service time of this replica's "
                    "finished requests (EWMA, clamped to [0.5, 4]); deadline admission multiplies its estimates by it",
                    registry=GATEWAY)
ADMISSION_WAIT = Histogram("pdserve_admission_wait_seconds", "Time queued for a reservation", buckets=LAT,
                           registry=GATEWAY)
DEGRADED_TOTAL = Counter("pdserve_degraded_total", "Requests admitted with a smaller n than asked",
                         registry=GATEWAY)
USAGE_RECORDS = Counter("pdserve_usage_records_total", "Billing records (one per client request)",
                        ["tenant", "state"], registry=GATEWAY)
USAGE_TOKENS = Counter("pdserve_usage_tokens_total", "Billed token counts per tenant",
                       ["tenant", "kind"], registry=GATEWAY)  # kind: prompt | generated | emitted | committed
