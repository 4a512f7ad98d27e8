"""Every way a gateway request can fail, as one typed reply both front doors render (HTTP JSON or gRPC status).

`reply_for` is the one mapping from an exception to what the client sees, what the billing record's terminal
state is, and which rejection counter it bumps. Router and worker details stay in the log under the request id
(redact.py); only a worker's INVALID_ARGUMENT (about the client's own input) keeps its scrubbed text, with the
parameter the worker named in its `pdserve-param` trailing metadata.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from pdserve.services.admission import AdmissionError
from pdserve.services.gateway import redact
from pdserve.services.gateway.dispatch import NoWorkersError, UpstreamError
from pdserve.services.gateway.ingress import retry_after
from pdserve.services.gateway.params import APIError
from pdserve.services.gateway.path import DisaggUnavailable

log = logging.getLogger("pdserve.gateway")

# engine parameter names -> the request field a client wrote
_CLIENT_PARAM = {"guided.regex": "guided_regex", "guided.grammar": "guided_grammar", "guided": "response_format"}


class RequestFailed(Exception):
    """A worker ended the request in a terminal state other than FINISHED (FAILED, TIMED_OUT, ...): `msg` is its
    last message, `detail` its text (logged, not sent)."""

    def __init__(self, state: str, detail: str | None, msg=None):
        super().__init__(detail or state)
        self.state, self.detail, self.msg = state, detail, msg


@dataclass
class ErrorReply:
    status: int  # HTTP status
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    state: str = "REJECTED"  # the request's terminal state (billing record)
    rejection: str | None = None  # pdserve_rejections_total label, if it counts as one

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_GRPC_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.INVALID_ARGUMENT,
                429: grpc.StatusCode.RESOURCE_EXHAUSTED, 500: grpc.StatusCode.INTERNAL,
                503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


def grpc_status(r: ErrorReply) -> tuple[grpc.StatusCode, str]:
    """The gRPC front door's rendering: a status code and `code: message` (the retry hint is in the message)."""
    return _GRPC_STATUS.get(r.status, grpc.StatusCode.UNKNOWN), f"{r.code or r.type}: {r.message}"


def client_param(param: str | None) -> str | None:
    if param is None:
        return None
    for engine_name, client_name in _CLIENT_PARAM.items():
        if param == engine_name or param.startswith(engine_name + "."):
            return client_name
    return param


def reply_for(e: BaseException) -> ErrorReply:
    """The reply to a request that ended with `e` before its response completed."""
    if isinstance(e, APIError):
        return ErrorReply(e.status, e.message, e.type, e.code, e.param, dict(getattr(e, "headers", None) or {}),
                          rejection=e.code or e.type)
    if isinstance(e, AdmissionError):
        headers = {"Retry-After": retry_after(e.retry_after_s)} if e.retry_after_s else {}
        typ = {400: "invalid_request_error", 504: "timeout_error"}.get(e.status, "service_unavailable_error")
        param = (e.param or "prompt") if e.status == 400 else None
        return ErrorReply(e.status, e.message, typ, e.code, param, headers, state=e.state,
                          rejection=e.code if e.state == "REJECTED" else None)
    if isinstance(e, RequestFailed):
        msg = redact.failure_message(e.state, e.detail)  # the worker's text is logged, not sent
        if e.state == "TIMED_OUT":  # the request's deadline passed (queued, preempted or running)
            return ErrorReply(504, msg, "timeout_error", "timeout", state=e.state)
        if e.msg is not None and e.msg.retryable:  # no worker left to finish it (a decode host gone): not a 500
            return ErrorReply(503, msg, "service_unavailable_error", "no_workers", headers={"Retry-After": "1"},
                              state=e.state)
        return ErrorReply(500, msg, "server_error", "failed", state=e.state)
    rid = redact.request_id.get()
    if isinstance(e, DisaggUnavailable):  # --require-disagg: refused before any worker ran it
        return ErrorReply(503, redact.with_id(str(e)), "service_unavailable_error", "disagg_unavailable",
                          headers={"Retry-After": "1"}, rejection="disagg_unavailable")
    if isinstance(e, NoWorkersError):
        log.warning("request %s: no workers: %s", rid, e)
        return ErrorReply(503, redact.with_id("no workers available"), "service_unavailable_error", "no_workers",
                          rejection="no_workers")
    if isinstance(e, UpstreamError):
        log.warning("request %s: worker answered %s: %s", rid, e.code.name, e.details)
        if e.code == grpc.StatusCode.INVALID_ARGUMENT:  # about the client's input: its text, scrubbed
            # REJECTED, not FAILED: the worker refused it before running anything (a schema that does not
            # compile, a limit), so, like the gateway's own refusals, it is not billed (spec §0.2, §1.7)
            return ErrorReply(400, redact.scrub(e.details), "invalid_request_error", "invalid_parameter",
                              client_param(e.param), state="REJECTED", rejection="invalid_request")
        if e.code == grpc.StatusCode.DEADLINE_EXCEEDED:  # the request's deadline passed on the worker
            return ErrorReply(504, redact.with_id("the request's deadline passed"), "timeout_error", "timeout",
                              state="TIMED_OUT")
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ErrorReply(503, redact.with_id("no capacity for this request now"), "service_unavailable_error",
                              "capacity", headers={"Retry-After": "1"}, state="FAILED", rejection="capacity")
        return ErrorReply(500, redact.with_id("a worker failed the request"), "server_error", e.code.name.lower(),
                          state="FAILED")
    if isinstance(e, asyncio.CancelledError):
        return ErrorReply(499, "client cancelled", "cancelled", state="CANCELLED")
    log.error("request %s: unexpected error", rid, exc_info=e)
    return ErrorReply(500, redact.with_id("internal error"), "server_error", state="FAILED")
