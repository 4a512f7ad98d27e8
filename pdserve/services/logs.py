"""Process logging: `--log-format text|json` (env PDSERVE_LOG_FORMAT), the request id of the request being served
on every line, and the trace / span ids when tracing is on (docs/observability.md).

The request id lives in a ContextVar: the gateway's HTTP guard and the gRPC server interceptor (grpc_context.py)
set it for the task serving a request, and asyncio copies it into every task that task starts, so a line logged
anywhere while the request is handled carries it without being passed down. A JSON line is one object:
`ts`, `level`, `logger`, `message`, `process`, `pid`, then `request_id`, `worker_role`, `trace_id`, `span_id`,
`exception` where they apply.
"""
from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import sys
import time
import uuid

from pdserve.services import tracing

FORMATS = ("text", "json")
REQUEST_ID_HEADER = "x-request-id"
NO_ID = "-"

# The id of the request being served; NO_ID outside one.
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_request_id", default=NO_ID)

# A client's id goes into log lines, response headers and gRPC metadata verbatim, so it is held to what every
# one of them carries safely (no spaces, quotes, control characters; bounded), which UUIDs, ULIDs and the
# usual `prefix-123` / base64 ids all meet. Anything else is replaced, never refused (docs/observability.md).
MAX_REQUEST_ID = 128
_VALID_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:+/=@-]{{0,{MAX_REQUEST_ID - 1}}}")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def valid_request_id(value: str | bytes | None) -> str | None:
    """`value` if it is an acceptable request id, else None."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return value if value and _VALID_ID.fullmatch(value) else None


def accept_request_id(value: str | bytes | None) -> str:
    """The client's id when it is acceptable, otherwise a new one."""
    return valid_request_id(value) or new_request_id()


class ContextFilter(logging.Filter):
    """Stamps each record with the process, the request id and (tracing on) the current trace / span ids."""

    def __init__(self, process: str, worker_role: str | None = None):
        super().__init__()
        self.process, self.worker_role = process, worker_role

    def filter(self, record: logging.LogRecord) -> bool:
        record.pd_process = self.process
        record.pd_worker_role = self.worker_role
        record.request_id = request_id.get()
        record.trace_id = record.span_id = None
        ids = tracing.current_ids()
        if ids is not None:
            record.trace_id, record.span_id = ids
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": getattr(record, "pd_process", None),
            "pid": record.process,
        }
        role = getattr(record, "pd_worker_role", None)
        if role:
            out["worker_role"] = role
        rid = getattr(record, "request_id", NO_ID)
        if rid != NO_ID:
            out["request_id"] = rid
        if getattr(record, "trace_id", None):
            out["trace_id"], out["span_id"] = record.trace_id, record.span_id
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """The classic line, with `[request id]` (and `trace=<id>`) after the logger name while a request is served."""

    def __init__(self, process: str):
        super().__init__(f"%(asctime)s {process}[%(process)d] %(levelname)s %(name)s%(pd_ctx)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", NO_ID)
        ctx = f" [{rid}]" if rid != NO_ID else ""
        if getattr(record, "trace_id", None):
            ctx += f" trace={record.trace_id}"
        record.pd_ctx = ctx
        return super().format(record)


def setup(process: str, fmt: str = "text", worker_role: str | None = None, stream=None) -> None:
    """Configure the root logger of a server process (replaces any handler set before). Level:
    PDSERVE_LOG_LEVEL (default INFO)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: choose from {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(process))
    # on the handler, not a logger: records of every logger (uvicorn's, grpc's, libraries') pass through it
    handler.addFilter(ContextFilter(process, worker_role))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper())
