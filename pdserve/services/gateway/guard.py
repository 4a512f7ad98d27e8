"""The gateway's outermost HTTP layer (issue 13, items 7-9): a request id, a header size limit, and the
catch-all for errors.

* Every request gets an id (`x-request-id` response header, `redact.request_id` while it is served): the handle
  that ties the client's error message to the details in the gateway's log.
* Request heads over `max_header_bytes` get 431 and the connection is closed. h11's own limit
  (`h11_max_incomplete_event_size`, set to the same number in server.py) only sees a head that is still
  incomplete; one that arrives whole in a single read passes it at any size (100 KB was accepted).
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

from pdserve.services.gateway import redact

log = logging.getLogger("pdserve.gateway")

MAX_HEADER_BYTES = 16 << 10
KEEP_ALIVE_5XX = frozenset({503, 504})  # deliberate answers (load shed, deadline): the connection is sound


def _error(status: int, message: str, type_: str, code: str) -> tuple[dict, bytes]:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, body


class HttpGuard:
    def __init__(self, app, max_header_bytes: int = MAX_HEADER_BYTES):
        self.app = app
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = redact.new_request_id()
        token = redact.request_id.set(rid)
        started = False

        async def guarded_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
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
                start, body = _error(431, f"request headers of {head} bytes exceed the limit of "
                                          f"{self.max_header_bytes} bytes", "invalid_request_error",
                                     "request_header_fields_too_large")
                start["headers"].append((b"connection", b"close"))
                await guarded_send(start)
                await guarded_send({"type": "http.response.body", "body": body})
                return
            await self.app(scope, receive, guarded_send)
        except Exception:
            log.exception("request %s: unhandled error", rid)
            if started:
                raise
            start, body = _error(500, redact.with_id("internal error"), "server_error", "internal_error")
            await guarded_send(start)  # adds Connection: close
            await guarded_send({"type": "http.response.body", "body": body})
        finally:
            redact.request_id.reset(token)
