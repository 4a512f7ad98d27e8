"""gRPC server/channel helpers: every server gets the standard health service and server reflection; every server
and channel carries the request's id and trace context (grpc_context.py)."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve._proto.pdserve.v1 import common_pb2, gateway_pb2, router_pb2, worker_pb2  # noqa: F401
from pdserve.services.grpc_context import ContextChannel, ContextServerInterceptor

# Streams carry small token deltas but Prefill responses carry NIXL agent metadata (a few KB to MB).
OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def make_server(service_names: list[str]) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    # the gateway's own service is the front door: its callers' ids are checked and echoed (grpc_context.py)
    server = grpc.aio.server(options=OPTIONS, interceptors=[ContextServerInterceptor(GATEWAY_SERVICE)])
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server, hs


async def set_serving(hs: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    st = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await hs.set(name, st)


# The gateway's channels to workers relay token streams to HTTP clients. With BDP probing gRPC grows a stream's
# receive window to megabytes on a fast link, so a slow client's output would pile up in the gateway instead of
# the worker's bounded per-request buffer (which is what pauses the request: docs/admission.md, Backpressure).
# Without it the window stays at its 64 KiB default.
RELAY_OPTIONS = [*OPTIONS, ("grpc.http2.bdp_probe", 0)]


def channel(address: str, relay: bool = False) -> grpc.aio.Channel:
    """A channel whose calls carry the calling task's request id and trace context (grpc_context.py)."""
    inner = grpc.aio.insecure_channel(address, options=RELAY_OPTIONS if relay else OPTIONS)
    return ContextChannel(inner)  # type: ignore[return-value] - the same interface


WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
