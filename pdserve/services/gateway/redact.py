"""What a client may see of an error that happened behind the gateway.

Worker and router errors carry internals: worker ids and addresses ("ipv4:10.0.3.7:7100: Connection refused"),
and the build paths of the libraries they come from ("[16:48:31] /project/cpp/json_schema_converter.cc:5088:
...", xgrammar). The client gets a fixed message per kind of failure, plus the HTTP request id; the details go to
the gateway's log under that id (`x-request-id` response header, set by guard.HttpGuard). The one exception is a
worker's INVALID_ARGUMENT: it describes the client's own input (a schema xgrammar cannot compile), so its text is
kept, with paths, addresses and timestamps cut out.
"""
from __future__ import annotations

import logging
import re

# The id of the request being served (guard.HttpGuard sets it for an HTTP request's task; the gRPC interceptor
# for a front-door call): the one on every log line (logs.py).
from pdserve.services.logs import request_id

log = logging.getLogger("pdserve.gateway")


_STAMP = re.compile(r"\[\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\]\s*")  # glog-style "[16:48:31] "
# an absolute path of two or more parts with an optional ":line" (and the ": " after it)
_PATH = re.compile(r"(?<![\w/])(?:[A-Za-z]:)?(?:[/\\][\w.+@~-]+){2,}(?::\d+)*:?\s*")
_ADDR = re.compile(r"\b(?:ipv[46]:|unix:)?(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"  # IPv4[:port]
                   r"|\[[0-9A-Fa-f:.]+\](?::\d+)?"  # [IPv6][:port]
                   r"|\b[A-Za-z][\w.-]*:\d{2,5}\b")  # host:port
MAX_CHARS = 300


def scrub(text: str, limit: int = MAX_CHARS) -> str:
    """`text` without timestamps, file paths and network addresses; one line, at most `limit` characters."""
    s = _STAMP.sub("", text or "")
    s = _PATH.sub("", s)
    s = _ADDR.sub("<address>", s)
    s = " ".join(s.split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


def with_id(message: str) -> str:
    return f"{message} (request id {request_id.get()})"


def failure_message(state: str, detail: str | None) -> str:
    """The client's message for a request a worker ended as FAILED / TIMED_OUT / ...; the detail is logged."""
    if detail:
        log.warning("request %s ended %s: %s", request_id.get(), state, detail)
    if state == "TIMED_OUT":
        return with_id("request timed out")
    return with_id(f"request {state.lower()} on a worker")
