"""uvicorn's h11 connection protocol plus the header read timeout it lacks.

uvicorn times a connection out only while it is idle between requests (`timeout_keep_alive`, armed when a response
completes) and every byte received disarms that timer. A client that opens a connection and sends nothing, or
sends a request head one byte every few seconds (slow loris), holds it for ever: 50 such connections were all
still open after 40 s. Here:

* from the moment a connection opens, or the first byte of a request on a kept-alive one, the head (request
  line + headers) must be complete within `header_timeout_s`, or the client gets 408 and the connection closes;
* when a response is complete while the client is still sending the request body (the app answered without
  reading it all: 401, 413, 408), the connection closes instead of waiting for the rest of the body, which a
  trickling client would never finish;
* a head that outgrows `h11_max_incomplete_event_size` before it is complete gets the same 431 the guard gives a
  complete head over the limit (guard.py), not uvicorn's plain-text 400: which of the two sees a big head depends on
  how TCP split it into reads, and the client must not be able to tell.

The body's own deadline is the ingress gate's (ingress.read_body, 408): the app knows when it reads one.
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.services.gateway.guard import error_response

_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm_head_timer()
        elif self.conn.their_state is h11.IDLE:
            if self.conn.trailing_data[0]:  # part of a request head is buffered: its clock runs from now
                self._arm_head_timer()
        else:  # the head is complete (the body, if any, is the app's to time)
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        buffered, _ = self.conn.trailing_data
        limit = self.config.h11_max_incomplete_event_size
        if len(buffered) <= limit:  # a malformed head, not a big one: uvicorn's 400
            super().send_400_response(msg)
            return
        start, body = error_response(431, f"request headers exceed the limit of {limit} bytes",
                                     "invalid_request_error", "request_header_fields_too_large")
        head = b"".join(k + b": " + v + b"\r\n" for k, v in start["headers"])
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n" + head
                             + b"connection: close\r\n\r\n" + body)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE or self.cycle is not None \
                and not self.cycle.response_complete:
            return
        self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def guarded_h11(header_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with this timeout."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s})
