"""`pdserve gateway`: the OpenAI HTTP API (uvicorn) and the gRPC Gateway service in one process."""
from __future__ import annotations

import logging
import socket

import uvicorn

from pdserve.engine.grammar_limits import limits_from_args
from pdserve.services.gateway.app import GatewayConfig, create_gateway
from pdserve.services.gateway.grpc_front import GatewayGrpc
from pdserve.services.gateway.protocol import guarded_h11  # noqa: E402,I001 - own line: fewer merge conflicts
from pdserve.services.grpc_util import GATEWAY_SERVICE, make_server, security, set_serving
from pdserve.services.pb import gateway_pb2_grpc
from pdserve.services.redis_conn import RedisAuth

log = logging.getLogger("pdserve.gateway")

# Send buffer of each client connection. Left alone, Linux autotunes it up to tcp_wmem's max (4 MiB on loopback
# here), so a client that stops reading parks megabytes in the gateway's kernel and the stream never pushes back
# on the worker (docs/admission.md, Backpressure). Fixed, the kernel doubles it and stops autotuning.
CLIENT_SNDBUF_BYTES = 32 << 10


def listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP listening socket; accepted connections inherit its bounded send buffer."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CLIENT_SNDBUF_BYTES)
    # Accepted sockets inherit this. uvicorn sets no TCP_NODELAY on connections of a socket handed to it, and
    # Nagle + the client's delayed ACK then hold each response's second write ~40 ms (measured: 44 ms vs 0.6 ms
    # per keep-alive request).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app, host: str, port: int, gcfg: GatewayConfig) -> uvicorn.Config:
    """uvicorn with the gateway's limits on slow clients and big heads (docs/reliability.md, "Hostile input")."""
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
        log_config=None,  # uvicorn's records go through the process's handler (logs.py: text or JSON)
        http=guarded_h11(gcfg.header_timeout_s),  # header read timeout (protocol.py); pins h11
        timeout_keep_alive=5,  # idle keep-alive connections
        # h11 refuses an incomplete head over this size; a complete one is guard.HttpGuard's to refuse (431)
        h11_max_incomplete_event_size=gcfg.max_header_bytes)


class _Server(uvicorn.Server):
    """uvicorn, gone at the latest `drain_s` + grace after the first SIGTERM/SIGINT (procutil.exit_deadline):
    uvicorn owns the gateway's signal handlers, so the deadline is armed here."""

    def __init__(self, config: uvicorn.Config, drain_s: float):
        super().__init__(config)
        self.drain_s = drain_s
        self.deadline = None

    def handle_exit(self, sig, frame) -> None:
        if self.deadline is None:
            from pdserve.services.procutil import EXIT_GRACE_S, exit_deadline
            self.deadline = exit_deadline(self.drain_s + EXIT_GRACE_S, "gateway")
        super().handle_exit(sig, frame)


async def serve(args) -> None:
    gw = create_gateway(GatewayConfig(
        args.model, args.served_model_name, args.router, redis_url=args.redis_url, api_keys_file=args.api_keys_file,
        max_body_bytes=args.max_body_bytes, default_timeout_s=args.default_timeout, max_timeout_s=args.max_timeout,
        admission_queue=args.admission_queue, max_queue_wait_s=args.max_queue_wait, kv_overcommit=args.kv_overcommit,
        reservation_lease_s=args.reservation_lease, max_header_bytes=args.max_header_bytes,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout, metrics_compat=args.metrics_compat,
        redis_auth=RedisAuth.from_args(args), registry_key=security().registry_key(),
        internal_token=security().token,
        tool_call_parser=args.tool_call_parser, default_max_tokens=args.default_max_tokens,
        max_logprob_entries=args.max_logprob_entries,
        migration_limit=args.migration_limit, require_disagg=bool(args.require_disagg), grammar_limits=limits_from_args(args), host=args.host,
        allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins))
    if args.metrics_port:  # unauthenticated, for a scraper on the service network (docs/admission.md, Trust model)
        from pdserve.services.metrics.exposition import serve as serve_metrics
        serve_metrics(gw.metrics, args.metrics_port, args.metrics_host or args.host)
    grpc_server = None
    if args.grpc_port:
        # the public front door: tenants authenticate by API key here, not by the internal token or certificate
        grpc_server, hs = make_server([GATEWAY_SERVICE], internal=False)
        gateway_pb2_grpc.add_GatewayServicer_to_server(
            GatewayGrpc(gw.handler, gw.parser, gw.config.grammar_limits), grpc_server)
        grpc_server.add_insecure_port(f"{args.host}:{args.grpc_port}")
        await grpc_server.start()
        await set_serving(hs, [GATEWAY_SERVICE], True)
    cfg = uvicorn_config(gw.app, args.host, args.port, gw.config)
    cfg.timeout_graceful_shutdown = min(cfg.timeout_graceful_shutdown, args.drain_timeout)
    server = _Server(cfg, args.drain_timeout)
    gw.lifecycle.start()  # a restarted gateway finalises its dead predecessor's records without waiting
    from pdserve.services.procutil import freeze_startup_heap
    freeze_startup_heap("gateway")
    log.info("gateway on http://%s:%d (grpc %s), router %s", args.host, args.port, args.grpc_port, args.router)
    await server.serve(sockets=[listen_socket(args.host, args.port)])  # returns after SIGTERM/SIGINT, having drained open connections
    # terminal paths still running (billing records, reservation releases, ReleaseKV) complete before exit
    await gw.lifecycle.close()
    await gw.dispatcher.close()
    if grpc_server is not None:
        await grpc_server.stop(grace=2)
