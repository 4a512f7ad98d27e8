"""`python -m pdserve.services.health_probe --port P --service S`: the grpc.health.v1 check over internal TLS.

Kubernetes' built-in gRPC probe speaks plaintext only, so with internal TLS on the chart probes router and workers
with this instead (an exec probe: it runs in the container, with the container's PDSERVE_TLS_* variables). Exit 0
when the service says SERVING, 1 otherwise. The health service needs no token (internal_security.OPEN_METHODS).
"""
from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.internal_security import ConfigError, InternalSecurity


def check(port: int, service: str, sec: InternalSecurity, timeout_s: float = 2.0) -> bool:
    address = f"127.0.0.1:{port}"
    creds = sec.channel_credentials()
    ch = grpc.secure_channel(address, creds, options=sec.channel_options()) if creds is not None \
        else grpc.insecure_channel(address)
    with ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.services.health_probe")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--service", default="")
    ap.add_argument("--timeout", type=float, default=2.0)
    a = ap.parse_args(argv)
    env = os.environ.get
    try:
        # the server's certificate names --tls-server-name (or 127.0.0.1, which the probe dials)
        sec = InternalSecurity.from_files(None, env("PDSERVE_TLS_CERT"), env("PDSERVE_TLS_KEY"), env("PDSERVE_TLS_CA"),
                                          env("PDSERVE_TLS_SERVER_NAME"))
    except ConfigError as e:
        print(f"health_probe: {e}", file=sys.stderr)
        return 2
    return 0 if check(a.port, a.service, sec, a.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
