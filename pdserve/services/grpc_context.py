"""A request's id and trace context across gRPC hops (docs/observability.md).

Client side (every channel grpc_util.channel makes): the calling task's request id goes out as `x-request-id`
metadata, and with tracing on a CLIENT span is opened per call and its `traceparent` sent. Both are added when
the call is made, in the caller's task, so they are the caller's (ContextChannel).

Server side (every server grpc_util.make_server makes): the handler runs with the caller's `x-request-id` in
logs.request_id, under a SERVER span parented by the caller's `traceparent`, and one access line is logged when
the RPC ends. On the gateway's own gRPC service (the front door) a missing or invalid id is replaced by a new one
and the id is echoed back as initial and trailing metadata. A worker's StageTimes in its replies become
`engine.*` child spans.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time

import grpc

from pdserve.services import logs, tracing

log = logging.getLogger("pdserve.rpc")

_TRACE_KEYS = ("traceparent", "tracestate", "baggage")
_QUIET = ("/grpc.health.", "/grpc.reflection.")  # probes and tooling: no context, no access line
# polled, not part of serving a request (the gateway's /health asks ListWorkers): their access line is DEBUG
_POLLED = frozenset({"ListWorkers", "GetStats", "Heartbeat", "Register", "GetAgentMetadata"})


def _outgoing(method: str, metadata) -> tuple[object, object]:
    """(the call's metadata with the context's id and traceparent added, the client span or None)."""
    rid = logs.request_id.get()
    client = tracing.start_client_span(method) if tracing.enabled() else None
    if rid == logs.NO_ID and client is None:
        return metadata, None
    md = [(k, v) for k, v in (metadata or ()) if k not in _TRACE_KEYS and k != logs.REQUEST_ID_HEADER]
    if rid != logs.NO_ID:
        md.append((logs.REQUEST_ID_HEADER, rid))
    span = None
    if client is not None:
        span, pairs = client
        md.extend(pairs)
    return tuple(md), span


class _ContextCallable:
    """A multi-callable that adds the caller's context to each call's metadata, synchronously, when the call is
    made (grpc's own client interceptors run in an extra task per call, which also delays the call's start)."""

    def __init__(self, inner, method: str):
        self._inner, self._method = inner, method

    def __call__(self, request, *, metadata=None, **kwargs):
        md, span = _outgoing(self._method, metadata)
        call = self._inner(request, metadata=md, **kwargs)
        if span is not None:
            try:
                call.add_done_callback(lambda _c: span.end())
            except Exception:  # noqa: BLE001 - the call did not take it: end the span now rather than never
                span.end()
        return call


class ContextChannel:
    """A grpc.aio channel whose unary-request calls carry the request id and trace context (the only kinds
    pdserve's services have; the streaming-request kinds and everything else are the channel's own)."""

    def __init__(self, inner: grpc.aio.Channel):
        self._inner = inner

    def unary_unary(self, method: str, *args, **kwargs):
        return _ContextCallable(self._inner.unary_unary(method, *args, **kwargs), method)

    def unary_stream(self, method: str, *args, **kwargs):
        return _ContextCallable(self._inner.unary_stream(method, *args, **kwargs), method)

    def __getattr__(self, name: str):  # close, channel_ready, get_state, stream_unary, ...
        return getattr(self._inner, name)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self._inner.close()


class _Scope:
    """One served RPC: its request id, span, timing and the engine times seen in its replies."""

    def __init__(self, method: str, metadata, front_door: bool):
        md = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
        given = md.get(logs.REQUEST_ID_HEADER)
        if front_door:
            self.rid = logs.accept_request_id(given)
        else:
            self.rid = logs.valid_request_id(given) or logs.NO_ID
        self.method = method
        self.front_door = front_door
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}
        self.rid_token = logs.request_id.set(self.rid)
        self.span = tracing.start_server_span(method.lstrip("/"), {k: md[k] for k in _TRACE_KEYS if k in md},
                                              {"rpc.system": "grpc", "rpc.method": method}) \
            if tracing.enabled() else None

    async def start(self, context) -> None:
        if self.front_door:
            pair = ((logs.REQUEST_ID_HEADER, self.rid),)
            context.set_trailing_metadata(pair)
            await context.send_initial_metadata(pair)

    def seen(self, msg) -> None:
        if self.span is None:
            return
        t = getattr(msg, "times", None)
        if t is None:
            return
        for f, v in t.ListFields():  # later messages repeat the engine's times; the KV pull's are on the first
            self.times[f.name] = v

    def end(self, context, error: BaseException | None) -> None:
        if error is None:
            status = "OK"
        elif isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            status = "CANCELLED"
        else:
            code = None
            with contextlib.suppress(Exception):
                code = context.code()
            status = code.name if isinstance(code, grpc.StatusCode) else type(error).__name__
        level = logging.DEBUG if self.method.rsplit("/", 1)[-1] in _POLLED else logging.INFO
        log.log(level, "%s %s in %.1f ms", self.method, status, (time.perf_counter() - self.t0) * 1e3)
        if self.span is not None:
            if self.times:
                tracing.stage_spans("engine", self.times, tracing.ENGINE_STAGES)
            self.span[0].set_attribute("rpc.grpc.status", status)
            tracing.end_server_span(self.span, failed=None if status in ("OK", "CANCELLED") else status)
        with contextlib.suppress(ValueError):  # reset in another context (a generator finalized elsewhere)
            logs.request_id.reset(self.rid_token)


# The exception is handed to _Scope.end inside the `except` block and never kept in a local: a frame that holds
# its own exception is a reference cycle (frame -> exception -> traceback -> frame), and a handler generator caught
# in one is finalized, and its cleanup run (ReleaseKV of pinned KV, engine aborts), only at a later cyclic GC.

def _wrap_unary(behavior, method: str, front_door: bool):
    async def handler(request, context):
        scope = _Scope(method, context.invocation_metadata(), front_door)
        try:
            await scope.start(context)
            reply = behavior(request, context)
            if inspect.isawaitable(reply):
                reply = await reply
            scope.seen(reply)
        except BaseException as e:
            scope.end(context, e)
            raise
        scope.end(context, None)
        return reply
    return handler


def _wrap_stream(behavior, method: str, front_door: bool):
    async def handler(request, context):
        scope = _Scope(method, context.invocation_metadata(), front_door)
        try:
            await scope.start(context)
            replies = behavior(request, context)
            if hasattr(replies, "__aiter__"):
                # closed here, so the handler's own cleanup runs when the call ends, not at garbage collection
                async with contextlib.aclosing(replies):
                    async for m in replies:
                        scope.seen(m)
                        yield m
            elif inspect.isawaitable(replies):  # a handler that writes with context.write()
                await replies
            else:
                for m in replies:
                    yield m
        except BaseException as e:  # GeneratorExit too: the call was cancelled while a reply was being sent
            scope.end(context, e)
            raise
        scope.end(context, None)
    return handler


class ContextServerInterceptor(grpc.aio.ServerInterceptor):
    """Sets the request's context for unary-request handlers (all pdserve's RPCs); `front_door_service` is the
    service whose callers are clients (their id is validated, replaced if missing, and echoed)."""

    def __init__(self, front_door_service: str | None = None):
        self.front_prefix = f"/{front_door_service}/" if front_door_service else None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_QUIET) or handler.request_streaming:
            return handler
        front = self.front_prefix is not None and method.startswith(self.front_prefix)
        if handler.response_streaming:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method, front))
        return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method, front))
