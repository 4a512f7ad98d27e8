"""Process logging: `--log-format text|json` (env PDSERVE_LOG_FORMAT), the request id of the request being served
on every line, and the trace / span ids when tracing is on (docs/observability.md).

The request id lives in a ContextVar: the gateway's HTTP guard and the gRPC server interceptor (grpc_context.py)
set it for the task serving a request, and asyncio copies it into every task that task starts, so a line logged
anywhere while the request is handled carries it without being passed down. A JSON line is one object:
`ts`, `level`, `logger`, `message`, `process`, `pid`, then `request_id`, `worker_role`, `trace_id`, `span_id`,
`exception` where they apply.

Nothing that logs waits for the sink. A record is formatted by the caller (its request and trace ids are the
caller's) and put on a bounded queue; one listener thread per process writes the lines to the stream. A sink that
stops reading (a supervisor that never reads the pipe, a stalled log collector) fills the queue, and further lines
are dropped and counted in `pdserve_log_lines_dropped_total` rather than blocking the caller: an event loop that
blocked in `write` once froze the whole gateway.
"""
from __future__ import annotations

import atexit
import contextvars
import io
import json
import logging
import logging.handlers
import os
import queue
import re
import sys
import threading
import time
import uuid

from pdserve import env_knobs
from pdserve.services import tracing
from pdserve.services.metrics.common import LOG_LINES_DROPPED

FORMATS = ("text", "json")
REQUEST_ID_HEADER = "x-request-id"
NO_ID = "-"
# Lines held for a slow sink: at ~200 bytes a line, a few MB and a few seconds of a busy gateway's debug output
# (PDSERVE_LOG_QUEUE_LINES overrides it).
QUEUE_LINES = 10_000
# What exit gives the listener to write the lines still queued: a sink that is stuck is not waited for longer.
STOP_TIMEOUT_S = 2.0

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


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """Formats the record in the caller and queues the finished line; a full queue drops it (counted)."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return logging.makeLogRecord({"msg": self.format(record), "levelno": record.levelno,
                                      "levelname": record.levelname, "name": record.name})

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            LOG_LINES_DROPPED.inc()

    def close(self) -> None:
        """`logging.shutdown()` writes the queued lines: what code that cannot import this module (the engine)
        calls before an `os._exit`. Closing is not the end of the handler: `logging.config` closes every handler
        it finds, and libraries call it at import (nixl does, at `import nixl_cu12`), so while this handler is
        still the root's and the process is not exiting, its listener goes on after writing what was queued."""
        stop()
        if not _exiting and _listener is not None and self in logging.getLogger().handlers:
            _listener.start()
        super().close()


class Listener(logging.handlers.QueueListener):
    """The thread that writes queued lines to the sink; `stop` is bounded, so a stuck sink cannot hold up exit."""

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        if self._thread is None:
            return
        try:
            self.queue.put(self._sentinel, timeout=timeout)
        except queue.Full:  # the sink took nothing for `timeout`: the queued lines are lost with the process
            self._thread = None
            return
        self._thread.join(timeout)
        self._thread = None


class FdSink(logging.Handler):
    """Writes each line straight to the stream's file descriptor, so a write stuck on a full pipe holds no lock that
    exit takes: not `sys.stderr`'s (flushed at exit), not its own (`createLock`)."""

    def __init__(self, fd: int, terminator: str):
        super().__init__()
        self.fd, self.terminator = fd, terminator

    def createLock(self) -> None:
        # No lock: the listener thread is its only writer, and `logging.shutdown` (atexit) takes every handler's
        # lock, which a write stuck on a full pipe would hold forever.
        self.lock = None

    def emit(self, record: logging.LogRecord) -> None:
        data = (self.format(record) + self.terminator).encode("utf-8", "backslashreplace")
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError:  # the reader is gone: there is nobody to tell
            pass


def _sink(stream, terminator: str = "\n") -> logging.Handler:
    """The listener's handler for `stream`: its file descriptor when it has one, else the stream (io.StringIO)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        sink = logging.StreamHandler(stream)
        sink.terminator = terminator
    else:
        stream.flush()  # what was written through the stream before goes out first
        sink = FdSink(fd, terminator)
    sink.setFormatter(logging.Formatter("%(message)s"))  # the line is finished in the caller
    return sink


class QueuedStream(io.TextIOBase):
    """A text stream whose writes are queued for a listener thread like log lines (bounded, dropped and counted
    when full): `pdserve up` prints its announcements and its children's fate on stdout / stderr, and must not stop
    supervising because nobody reads them.

    Whole lines only: `print(x)` writes `x` and the newline in two calls, and another thread's line queued between
    them once glued a `PDSERVE_CHILD` announcement onto the end of a restart message, where `UpProcess` (which
    reads lines that start with it) never saw it. Each thread's text is held until its newline (or `flush`)."""

    def __init__(self, stream):
        self._handler = DroppingQueueHandler(queue.Queue(QUEUE_LINES))
        # the text is written as given (it carries its own newlines)
        self._listener = Listener(self._handler.queue, _sink(stream, terminator=""))
        self._listener.start()
        self._partial = threading.local()  # this thread's text after its last newline
        atexit.register(self.stop)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        held = getattr(self._partial, "text", "") + text
        cut = held.rfind("\n") + 1
        self._partial.text = held[cut:]
        if cut:
            self._handler.enqueue(logging.makeLogRecord({"msg": held[:cut]}))
        return len(text)

    def flush(self) -> None:
        held = getattr(self._partial, "text", "")
        if held:
            self._partial.text = ""
            self._handler.enqueue(logging.makeLogRecord({"msg": held}))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self.flush()
        self._listener.stop(timeout)


_listener: Listener | None = None
_exiting = False  # set at exit: a handler closed from then on ends its listener for good


def stop(timeout: float = STOP_TIMEOUT_S) -> None:
    """Write the lines queued so far (for at most `timeout` s) and end the listener thread: at exit, and before
    an `os._exit`."""
    if _listener is not None:
        _listener.stop(timeout)


def _at_exit() -> None:
    global _exiting
    _exiting = True
    stop()


atexit.register(_at_exit)


def setup(process: str, fmt: str = "text", worker_role: str | None = None, stream=None) -> None:
    """Configure the root logger of a server process (replaces any handler set before). Level:
    PDSERVE_LOG_LEVEL (default INFO); lines queued for the sink at most: PDSERVE_LOG_QUEUE_LINES."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: choose from {', '.join(FORMATS)}")
    global _listener
    stop()  # the previous listener writes what it holds before its stream is replaced
    sink = _sink(stream if stream is not None else sys.stderr)
    handler = DroppingQueueHandler(queue.Queue(int(env_knobs.get("PDSERVE_LOG_QUEUE_LINES") or QUEUE_LINES)))
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(process))
    # on the handler, not a logger: records of every logger (uvicorn's, grpc's, libraries') pass through it
    handler.addFilter(ContextFilter(process, worker_role))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    _listener = Listener(handler.queue, sink)
    _listener.start()
    root.setLevel(env_knobs.get("PDSERVE_LOG_LEVEL").upper())
