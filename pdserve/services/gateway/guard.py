"""The gateway's outermost HTTP layer: a request id, a header size limit, and the
catch-all for errors.

* Every request gets an id (`x-request-id` response header, `redact.request_id` while it is served): the handle
  that ties the client's error message to the details in the gateway's log. A client's own `x-request-id` is
  kept when it is acceptable (logs.valid_request_id) and replaced otherwise, never refused; the id then travels
  to the router and workers as gRPC metadata and is on every log line of the request (docs/observability.md).
  With tracing on, the request is a SERVER span, child of the client's `traceparent` (tracing.py), and one access
  line is logged per request.
* Request heads over `max_header_bytes` get 431 and the connection is closed. h11's own limit
  (`h11_max_incomplete_event_size`, set to the same number in server.py) only sees a head that is still
  incomplete; one that arrives whole in a single read passes it at any size (100 KB was accepted). A head h11
  refuses gets the same 431 (protocol.py), so TCP's split of it into reads does not change the answer.
* Any 5xx response but the gateway's deliberate 503 / 504 carries `Connection: close`, so the server closes the
  connection after it, in order, and the client knows not to reuse it. Before, an unhandled exception sent a 500
  without it and then dropped the keep-alive connection, so the client's next request on it failed. A 503 (no
  capacity, no workers: load shed, with Retry-After) or 504 (deadline) is a complete answer on a sound connection:
  closing it would make every shed request cost a reconnect, at the moment the gateway is busiest.
* An exception nothing else handled becomes a 500 with a fixed message and the request id; the traceback goes to
  the log, not to the client. After the response has started (a stream) it can only be logged and re-raised:
  uvicorn then closes the connection, and the unterminated chunked body tells the client the answer is cut.
"""
from __future__ import annotations

import json
import logging
import time

from pdserve.services import logs, tracing
from pdserve.services.gateway import redact

log = logging.getLogger("pdserve.gateway")
access = logging.getLogger("pdserve.access")

MAX_HEADER_BYTES = 16 << 10
POLLED_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers: their access line is DEBUG
KEEP_ALIVE_5XX = frozenset({503, 504})  # deliberate answers (load shed, deadline): the connection is sound


def error_response(status: int, message: str, type_: str, code: str) -> tuple[dict, bytes]:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, body


def fastapi_options() -> dict:
    """FastAPI's own tracing off, where it has one (newer releases open their own SERVER span once a tracer
    provider is set): the guard's span is the request's, the one that carries its id and the stage spans, and two
    sibling spans per request would split each trace."""
    import inspect

    from fastapi import FastAPI
    return {"telemetry": {"tracing": False}} if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {}


class HttpGuard:
    def __init__(self, app, max_header_bytes: int = MAX_HEADER_BYTES):
        self.app = app
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid, carrier = _request_id(scope)
        token = redact.request_id.set(rid)
        span = _server_span(scope, rid, carrier) if tracing.enabled() else None
        started = False
        status = 0
        t0 = time.perf_counter()
        error: BaseException | None = None

        async def guarded_send(message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                headers = list(message.get("headers", ()))
                headers.append((b"x-request-id", rid.encode()))
                if message["status"] >= 500 and message["status"] not in KEEP_ALIVE_5XX \
                        and not any(k.lower() == b"connection" for k, _ in headers):
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        try:
            head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") \
                + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if head > self.max_header_bytes:
                await _send_error(guarded_send, 431, f"request headers of {head} bytes exceed the limit of "
                                                     f"{self.max_header_bytes} bytes", "invalid_request_error",
                                  "request_header_fields_too_large", close=True)
                return
            await self.app(scope, receive, guarded_send)
        except Exception as e:
            error = e
            log.exception("request %s: unhandled error", rid)
            if started:
                raise
            await _send_error(guarded_send, 500, redact.with_id("internal error"), "server_error",
                              "internal_error")  # guarded_send adds Connection: close
        except BaseException as e:  # cancelled (the server stopping): still ends the span and the access line
            error = e
            raise
        finally:
            access.log(logging.DEBUG if scope.get("path") in POLLED_PATHS else logging.INFO,
                       "%s %s %s in %.1f ms", scope.get("method"), scope.get("path"), status or "-",
                       (time.perf_counter() - t0) * 1e3)
            if span is not None:
                span[0].set_attribute("http.response.status_code", status)
                tracing.end_server_span(span, error, f"HTTP {status}" if status >= 500 else None)
            redact.request_id.reset(token)


def _request_id(scope) -> tuple[str, dict[str, str]]:
    """The request's id (the client's `x-request-id` when acceptable, else a new one) and the trace context the
    client sent (`traceparent`, `tracestate`)."""
    given, carrier = None, {}
    for k, v in scope["headers"]:
        if k == b"x-request-id":
            given = v
        elif k in (b"traceparent", b"tracestate"):
            carrier[k.decode()] = v.decode("latin-1")
    return logs.accept_request_id(given), carrier


def _server_span(scope, rid: str, carrier: dict[str, str]):
    return tracing.start_server_span(f"{scope.get('method', 'GET')} {scope.get('path', '')}", carrier,
                                     {"http.request.method": scope.get("method", ""),
                                      "url.path": scope.get("path", ""), "pdserve.request_id": rid})


async def _send_error(send, status: int, message: str, type_: str, code: str, close: bool = False) -> None:
    start, body = error_response(status, message, type_, code)
    if close:
        start["headers"].append((b"connection", b"close"))
    await send(start)
    await send({"type": "http.response.body", "body": body})
