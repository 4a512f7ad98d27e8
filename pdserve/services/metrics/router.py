"""The router's families (docs/routing.md)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.services.metrics.common import LAT, REJECTIONS  # noqa: F401 - the router counts `no_workers`

ROUTER = CollectorRegistry(auto_describe=True)

ROUTED = Counter("pdserve_routed_total", "Router placements", ["mode"], registry=ROUTER)
ROUTE_DECISIONS = Counter("pdserve_route_decisions_total", "Router decisions by placement mode and reason",
                          ["mode", "reason"], registry=ROUTER)
ROUTE_DEGRADED = Counter("pdserve_route_degraded_total",
                         "Requests prefilled locally on a decode worker because the prefill pool was down/failing",
                         ["reason"], registry=ROUTER)
ROUTE_PREDICTED_TTFT = Histogram("pdserve_route_predicted_ttft_seconds", "The router's TTFT prediction",
                                 buckets=LAT, registry=ROUTER)
ROUTE_PROMPT_TOKENS = Counter("pdserve_route_prompt_tokens_total", "Prompt tokens routed", registry=ROUTER)
ROUTE_CACHED_TOKENS = Counter("pdserve_route_cached_tokens_total",
                              "Prompt tokens the prefix index predicted cached where the request went "
                              "(ratio to pdserve_route_prompt_tokens_total = routed prefix hit ratio)",
                              registry=ROUTER)
PREFIX_INDEX_BLOCKS = Gauge("pdserve_prefix_index_blocks", "Distinct (namespace, block) keys in the router index",
                            registry=ROUTER)
PREFIX_INDEX_EVENTS = Counter("pdserve_prefix_index_events_total", "KV events applied to the router index",
                              registry=ROUTER)
