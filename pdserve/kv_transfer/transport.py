"""Which transport the KV may move over, as configured.

NIXL's UCX backend lets UCX pick a transport per peer from those UCX_TLS allows: shared memory (posix / sysv /
cma) between processes of one host, rc / dc (RDMA) or tcp between hosts. This is the configuration:
`source=configured` with UCX_TLS's value, or `transport=auto` when UCX_TLS is unset (UCX's own choice: on one host
that bypasses the network, docs/lab.md). What UCX then chose for each peer is read from UCX's own report
(ucx_log.py, ucx_proto_info.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Transport:
    backend: str
    transport: str  # UCX_TLS as configured ("tcp", "rc,sm", ...) or "auto"
    source: str  # "configured" (UCX_TLS set) or "default" (UCX picks)

    def line(self) -> str:
        return f"{self.backend}/{self.transport} ({self.source})"


def configured(env: dict[str, str] | None = None, backend: str = "UCX") -> Transport:
    env = os.environ if env is None else env
    tls = ",".join(t.strip() for t in env.get("UCX_TLS", "").split(",") if t.strip())
    return Transport(backend, tls or "auto", "configured" if tls else "default")
