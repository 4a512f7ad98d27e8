"""What every pdserve process exports: its own rejections and the standard process/runtime collectors. Also the
histogram buckets the role modules share."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, GCCollector, PlatformCollector, ProcessCollector

LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

COMMON = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=COMMON)
GCCollector(registry=COMMON)
PlatformCollector(registry=COMMON)

# Each process counts the rejections it decides (gateway: ingress/admission/upstream answers; router: no
# workers; worker: invalid input, KV layout mismatch, decode KV full), so the reasons do not overlap.
REJECTIONS = Counter("pdserve_rejections_total", "Requests this process rejected before running", ["reason"],
                     registry=COMMON)

# internal security (docs/services.md, Trust model): the router and the gateway read the worker registry
REGISTRY_REJECTED = Counter("pdserve_registry_rejected_records_total",
                            "Worker registry records skipped because their HMAC does not verify (forged or written "
                            "without the internal token)", registry=COMMON)

# logs.py: lines a full log queue dropped because the sink (stderr's pipe, a collector) was not keeping up
LOG_LINES_DROPPED = Counter("pdserve_log_lines_dropped_total", "Log lines dropped because the log sink did not keep "
                            "up (its queue was full): the process never waits for its log output", registry=COMMON)
