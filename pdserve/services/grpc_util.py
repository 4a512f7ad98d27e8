"""gRPC server/channel helpers: every server gets the standard health service (and server reflection while no
internal auth is configured); every internal server and channel uses the process's internal security
(internal_security.py), set once at start-up by `configure`; every server and channel carries the request's id and
trace context (grpc_context.py)."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve._proto.pdserve.v1 import common_pb2, gateway_pb2, router_pb2, worker_pb2  # noqa: F401
from pdserve.services.grpc_context import ContextChannel, ContextServerInterceptor
from pdserve.services.internal_security import NONE, InternalSecurity

# Streams carry small token deltas but Prefill responses carry NIXL agent metadata (a few KB to MB).
# A peer that restarts (a router, a worker) is back in seconds: reconnect attempts at most 1 s apart, not gRPC's
# default backoff (1 s growing to 120 s), during which calls on the channel fail at once with UNAVAILABLE (with two
# routers, the one a gateway fails over to may be one that restarted a while ago).
# gRPC reads `min_reconnect_backoff_ms` as the time one connection attempt gets to finish (TCP, TLS, the peer's
# SETTINGS frame), not as a backoff. At 100 ms a TLS handshake with a worker on a loaded host timed out and the
# request failed 503 (CI, the chart's mTLS variant); at gRPC's default, 20 s, a call to a blackholed peer waits
# that long before it fails over. CONNECT_TIMEOUT_MS sits between: calls queue while a connection is attempted.
CONNECT_TIMEOUT_MS = 2000
OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
           ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
           ("grpc.max_reconnect_backoff_ms", 1000)]

# A peer that stops answering (SIGSTOPped, wedged host, blackholed port) while a call is open: the connection
# stays up and the call would wait for the caller's deadline. An HTTP/2 PING every KEEPALIVE_MS while calls are
# open, unanswered for KEEPALIVE_TIMEOUT_MS, closes the connection and fails its calls UNAVAILABLE, so a client
# whose stream sits on a silent worker gets its error (or its request moved) ~3 s after the worker went silent,
# within 2 heartbeat TTLs (docs/reliability.md, "Fault matrix"). PINGs are answered by gRPC's transport, not by
# the worker's Python code, so a long engine step does not trip it. Servers accept the PINGs (the default policy
# answers pings more often than every 5 min with GOAWAY after 2 strikes).
KEEPALIVE_MS = 1000
KEEPALIVE_TIMEOUT_MS = 2000
CLIENT_KEEPALIVE = [("grpc.keepalive_time_ms", KEEPALIVE_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                    ("grpc.keepalive_permit_without_calls", 0), ("grpc.http2.max_pings_without_data", 0),
                    ("grpc.http2.min_time_between_pings_ms", KEEPALIVE_MS),
                    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS)]  # any ping: BDP probes too (60 s)
SERVER_KEEPALIVE = [("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
                    ("grpc.http2.max_ping_strikes", 0)]


_security: InternalSecurity = NONE


def configure(security: InternalSecurity) -> None:
    """The process's internal identity (token, TLS): every later `channel`, `make_server` and `listen` uses it."""
    global _security
    _security = security


def security() -> InternalSecurity:
    return _security


def make_server(service_names: list[str], internal: bool = True) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """`internal=False` for the gateway's public front door, which authenticates tenants by API key instead."""
    sec = _security if internal else NONE
    # the gateway's own service is the front door: its callers' ids are checked and echoed (grpc_context.py)
    server = grpc.aio.server(options=[*OPTIONS, *SERVER_KEEPALIVE], interceptors=[ContextServerInterceptor(GATEWAY_SERVICE),
                                                            *sec.server_interceptors()])
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if not sec.token and not sec.mutual:
        # Reflection lists every method and message: useful on loopback, a map for an intruder once callers are
        # meant to be authenticated. With a token it would sit behind the check anyway; closed outright.
        reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server, hs


def listen(server: grpc.aio.Server, address: str) -> int:
    """Bind an internal server: TLS (mutual with a CA) when configured, plaintext otherwise."""
    creds = _security.server_credentials()
    return server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)


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
    """A channel to an internal service (router, worker), with the process's token and TLS; its calls carry the
    calling task's request id and trace context (grpc_context.py)."""
    options = [*(RELAY_OPTIONS if relay else OPTIONS), *CLIENT_KEEPALIVE, *_security.channel_options()]
    interceptors = _security.client_interceptors() or None
    creds = _security.channel_credentials()
    if creds is not None:
        inner = grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
    else:
        inner = grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return ContextChannel(inner)  # type: ignore[return-value] - the same interface


WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


PARAM_METADATA = "pdserve-param"  # trailing metadata of an INVALID_ARGUMENT: the request parameter refused


def param_metadata(e: Exception) -> tuple:
    """Trailing metadata naming the parameter an `InvalidParameter` refused (none for other errors)."""
    param = getattr(e, "param", None)
    return ((PARAM_METADATA, param),) if param else ()


async def abort_compile_timeout(context, e) -> None:
    """A guided request whose grammar was not compiled in time (engine/grammar_pool.CompileTimeout): its deadline
    passed (DEADLINE_EXCEEDED: the gateway answers 504), or every compiler was busy (RESOURCE_EXHAUSTED: 503,
    retry)."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED if e.why == "deadline" else grpc.StatusCode.RESOURCE_EXHAUSTED
    await context.abort(code, str(e))


def param_of(e: grpc.aio.AioRpcError) -> str | None:
    """The parameter a peer's INVALID_ARGUMENT named in its trailing metadata, if any."""
    for k, v in e.trailing_metadata() or ():
        if k == PARAM_METADATA:
            return v
    return None
