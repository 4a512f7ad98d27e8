"""Who may call the internal gRPC services (router, workers): a shared token and/or mutual TLS.

- Token: read from a file (`--internal-token-file`, a mounted Secret; never the value itself on a command line,
  where `ps` and pod specs show it). Clients send it as `authorization: Bearer <token>` on every call; servers
  compare it in constant time and answer UNAUTHENTICATED otherwise. The standard health service stays open (probes
  carry no credentials; it says SERVING or not and nothing else); reflection is closed with the rest.
- TLS: `--tls-cert/--tls-key` make servers speak TLS and clients require it. With `--tls-ca` too, servers require
  and verify a client certificate signed by that CA (mTLS) and clients verify the server against it (instead of
  the system roots) and present their own certificate. `--tls-server-name` is the name clients expect in the
  server's certificate when it differs from the host they dial (pod IPs: one shared SAN for every internal cert).
- The token also keys the registry's record HMAC (registry.py): a process without it cannot register a worker.
- Closed by default: `pdserve up` generates a token (and its private Redis' password) unless given one; a router or
  worker alone without a token or mTLS refuses a non-loopback address unless `--insecure-internal`, and every
  process without them says so at WARNING (`open_warning`).

A process has one internal identity, set once at start-up (`grpc_util.configure`), and every channel and server
it opens uses it: the trust model is in docs/services.md ("Trust model").
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("pdserve.security")

MIN_TOKEN_CHARS = 16
AUTH_HEADER = "authorization"
# Probes (kubelet's grpc probe, `pdserve up`'s readiness) carry no credentials.
OPEN_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


class ConfigError(ValueError):
    """A security flag that cannot work (one line for the CLI)."""


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path}: {e.strerror or e}") from None
    if not data.strip():
        raise ConfigError(f"{what} {path}: empty")
    return data


def read_token(path: str) -> str:
    token = _read(path, "--internal-token-file").decode("ascii", "replace").strip()
    if len(token) < MIN_TOKEN_CHARS or not all(33 <= ord(c) < 127 for c in token):
        raise ConfigError(f"--internal-token-file {path}: the token must be at least {MIN_TOKEN_CHARS} printable "
                          "ASCII characters without spaces (e.g. `openssl rand -hex 32`)")
    return token


@dataclass(frozen=True)
class InternalSecurity:
    token: str | None = None
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_files(cls, token_file: str | None = None, cert: str | None = None, key: str | None = None,
                   ca: str | None = None, server_name: str | None = None) -> "InternalSecurity":
        if bool(cert) != bool(key):
            raise ConfigError("--tls-cert and --tls-key go together (the certificate and its private key)")
        if ca and not cert:
            raise ConfigError("--tls-ca turns on mutual TLS, which needs --tls-cert and --tls-key too "
                              "(servers present them, clients prove themselves with them)")
        if server_name and not cert:
            raise ConfigError("--tls-server-name needs TLS (--tls-cert, --tls-key)")
        return cls(token=read_token(token_file) if token_file else None,
                   cert=_read(cert, "--tls-cert") if cert else None, key=_read(key, "--tls-key") if key else None,
                   ca=_read(ca, "--tls-ca") if ca else None, server_name=server_name or None)

    @classmethod
    def from_args(cls, args) -> "InternalSecurity":
        return cls.from_files(getattr(args, "internal_token_file", None), getattr(args, "tls_cert", None),
                              getattr(args, "tls_key", None), getattr(args, "tls_ca", None),
                              getattr(args, "tls_server_name", None))

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def mutual(self) -> bool:
        return self.ca is not None

    @property
    def authenticated(self) -> bool:
        """Callers must prove themselves: a token, or a client certificate the CA signed."""
        return self.token is not None or self.mutual

    def describe(self) -> str:
        parts = (["token"] if self.token else []) + (["mTLS" if self.mutual else "TLS"] if self.tls else [])
        return "+".join(parts) or "none"

    # ---- servers --------------------------------------------------------------------------------------------

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenCheck(self.token)] if self.token else []

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.mutual)

    # ---- clients --------------------------------------------------------------------------------------------

    def client_interceptors(self) -> list:
        return token_senders(self.token) if self.token else []

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        if self.mutual:
            return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                                certificate_chain=self.cert)
        return grpc.ssl_channel_credentials()  # the system roots verify the server

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.tls and self.server_name else []

    # ---- registry -------------------------------------------------------------------------------------------

    def registry_key(self) -> bytes | None:
        """A key of its own for the registry HMAC (not the bearer token itself: one secret, two uses kept apart)."""
        if not self.token:
            return None
        return hmac.new(self.token.encode(), b"pdserve registry record v1", hashlib.sha256).digest()


NONE = InternalSecurity()

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def exposure_problem(command: str, host: str, sec: InternalSecurity, insecure: bool) -> str | None:
    """A router or worker that would serve its RPCs beyond this host to anyone: refused unless asked for. (The
    gateway serves no internal RPC; its own doors are the tenants'.)"""
    if command not in ("router", "worker") or sec.authenticated or insecure or is_loopback(host):
        return None
    return (f"refusing to serve {command} RPCs on {host} without authentication: give --internal-token-file "
            "(and/or mutual TLS: --tls-cert, --tls-key, --tls-ca), or --insecure-internal to run it open "
            "(docs/services.md, Trust model)")


def open_warning(command: str, sec: InternalSecurity) -> str | None:
    """What a process without internal authentication leaves open, for one WARNING line at start; None if closed."""
    if sec.authenticated:
        return None
    what = {"router": "its Route/ListWorkers RPCs answer any caller that reaches its port",
            "worker": "its Generate/Prefill/KV RPCs answer any caller that reaches its port (prompts and outputs)",
            "gateway": "its calls to the router and workers carry no credential"}[command]
    return (f"internal RPCs are unauthenticated: {what}, and worker registry records are unsigned (any process that "
            "can write to Redis can register a worker and receive prompts); give --internal-token-file "
            "(docs/services.md, Trust model)")


def _bearer(metadata) -> str | None:
    for k, v in metadata or ():
        if k == AUTH_HEADER:
            return v if isinstance(v, str) else v.decode("latin-1")
    return None


class TokenCheck(grpc.aio.ServerInterceptor):
    """Server side: every method but the health check needs `authorization: Bearer <token>`."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def ok(self, metadata) -> bool:
        got = _bearer(metadata)
        return got is not None and hmac.compare_digest(got.encode("latin-1", "replace"), self._expected)

    async def intercept_service(self, continuation, details):
        if details.method in OPEN_METHODS or self.ok(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:  # unknown method: UNIMPLEMENTED says nothing an attacker can use
            return None
        return _refusal(handler, "missing or wrong internal token" if _bearer(details.invocation_metadata)
                        is not None else "internal token required (authorization: Bearer ...)")


def _refusal(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    async def unary(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def streaming(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover - abort raises; this makes the function a generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class _TokenSender:
    """Client side: adds `authorization: Bearer <token>` to every call on the channel."""

    def __init__(self, token: str):
        self._value = f"Bearer {token}"

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        md = grpc.aio.Metadata(*[(k, v) for k, v in (d.metadata or ()) if k != AUTH_HEADER])
        md.add(AUTH_HEADER, self._value)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready)


# grpc.aio files an interceptor under the first of the four kinds it is an instance of (an if/elif chain), so one
# object cannot serve all four: one class per kind.
class _UnaryUnary(_TokenSender, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_TokenSender, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_TokenSender, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_TokenSender, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def token_senders(token: str) -> list:
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
