"""What one process serves on /metrics: the shared families and its role's, every sample labelled with the
process's constant labels, plus the vLLM aliases when asked for.

The constant labels (`model`: the served model name; `role` on workers) are added here rather than at each call
site because a pdserve process serves exactly one model in one role: the value cannot differ between the samples
of a process, and call sites stay free of it."""
from __future__ import annotations

import logging
from typing import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from pdserve.services.metrics import vllm_compat
from pdserve.services.metrics.common import COMMON

log = logging.getLogger("pdserve.metrics")
COMPAT_CHOICES = ("vllm",)


class ProcessMetrics(Collector):
    """The families of `sources` with `labels` added to every sample, then their aliases (one collect of the
    sources per scrape: an alias carries the same value as its native sample by construction)."""

    def __init__(self, sources: Iterable[CollectorRegistry], labels: dict[str, str], compat: str | None = None):
        if compat not in (None, "", *COMPAT_CHOICES):
            raise ValueError(f"unknown metrics compat {compat!r} (choose from {', '.join(COMPAT_CHOICES)})")
        self.sources = list(sources)
        self.labels = dict(labels)
        self.compat = compat or None

    def _natives(self) -> list[Metric]:
        out = []
        for src in self.sources:
            for fam in src.collect():
                m = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                m.samples = [Sample(s.name, {**self.labels, **s.labels}, s.value, s.timestamp, s.exemplar)
                             for s in fam.samples]
                out.append(m)
        return out

    def collect(self) -> Iterable[Metric]:
        natives = self._natives()
        yield from natives
        if self.compat == "vllm":
            yield from vllm_compat.aliases(natives)


def exposition(role: CollectorRegistry, labels: dict[str, str], compat: str | None = None) -> CollectorRegistry:
    """A registry holding exactly this process's metrics: hand it to `serve` or `generate_latest`."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ProcessMetrics([COMMON, role], labels, compat))
    return reg


def serve(registry: CollectorRegistry, port: int, host: str) -> None:
    """The unauthenticated metrics port, bound to the service's host (the chart passes 0.0.0.0 to pods)."""
    from prometheus_client import start_http_server
    start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)
