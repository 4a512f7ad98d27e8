"""pdserve/services/logs.py: request-id validation, the JSON and text formats, the id following a request's tasks,
the --log-format flag / PDSERVE_LOG_FORMAT, and a stuck sink never blocking the caller."""
from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import threading
import time

import pytest

from pdserve.cli import build_parser
from pdserve.services import logs


@pytest.mark.parametrize("rid", ["abc-123", "0b8f6a2e-6c1f-4f57-9d1c-2a3b4c5d6e7f", "01HZX3Y4Z5ABCDEFGHJKMNPQRS",
                                 "trace:span.7", "dGVzdA==", "a", "A" * 128, "user@tenant/req+1"])
def test_acceptable_ids_are_kept(rid):
    assert logs.valid_request_id(rid) == rid
    assert logs.accept_request_id(rid) == rid
    assert logs.accept_request_id(rid.encode()) == rid


@pytest.mark.parametrize("rid", ["", "A" * 129, "has space", "tab\there", "new\nline", "semi;colon", 'quo"te',
                                 "-dash-first", "ünïcode", b"\xff\xfe", "<script>", "a,b", None])
def test_unacceptable_ids_are_replaced(rid):
    assert logs.valid_request_id(rid) is None
    new = logs.accept_request_id(rid)
    assert new.startswith("req-") and len(new) == 20 and logs.valid_request_id(new) == new
    assert logs.accept_request_id(rid) != new  # a fresh one each time


@pytest.fixture
def capture():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buf = io.StringIO()
    yield buf
    logs.stop()
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_json_lines_carry_the_request_id_into_child_tasks(capture):
    logs.setup("worker", "json", worker_role="decode", stream=capture)
    log = logging.getLogger("pdserve.test")

    async def serve(rid: str) -> None:
        logs.request_id.set(rid)
        log.info("start %s", rid)
        await asyncio.gather(asyncio.create_task(child()), asyncio.sleep(0))

    async def child() -> None:
        await asyncio.sleep(0.01)
        log.warning("child")

    async def main():
        await asyncio.gather(serve("r-1"), serve("r-2"))
        log.info("outside")

    asyncio.run(main())
    logs.stop()  # the listener thread has written every queued line
    lines = [json.loads(x) for x in capture.getvalue().splitlines()]
    by_msg = {(x["message"], x.get("request_id")) for x in lines}
    assert by_msg == {("start r-1", "r-1"), ("start r-2", "r-2"), ("child", "r-1"), ("child", "r-2"),
                      ("outside", None)}
    for x in lines:
        assert x["process"] == "worker" and x["worker_role"] == "decode" and x["logger"] == "pdserve.test"
        assert x["level"] in ("INFO", "WARNING") and isinstance(x["pid"], int) and x["ts"].endswith("Z")
        assert "trace_id" not in x  # tracing is off in this process


def test_json_exception_and_text_format(capture):
    logs.setup("gateway", "json", stream=capture)
    token = logs.request_id.set("e-1")
    try:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("x").exception("failed: %s", "why")
    finally:
        logs.request_id.reset(token)
    logs.stop()
    x = json.loads(capture.getvalue())
    assert x["message"] == "failed: why" and x["request_id"] == "e-1" and "RuntimeError: boom" in x["exception"]
    assert x["level"] == "ERROR" and x["process"] == "gateway" and "worker_role" not in x

    text = io.StringIO()
    logs.setup("router", "text", stream=text)
    token = logs.request_id.set("t-9")
    logging.getLogger("pdserve.rpc").info("in")
    logs.request_id.reset(token)
    logging.getLogger("pdserve.rpc").info("out")
    logs.stop()
    first, second = text.getvalue().splitlines()
    assert " router[" in first and " INFO pdserve.rpc [t-9]: in" in first
    assert second.endswith(" INFO pdserve.rpc: out")


def test_level_from_env_and_unknown_format(capture, monkeypatch):
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "warning")
    logs.setup("router", "json", stream=capture)
    logging.getLogger("q").info("hidden")
    logging.getLogger("q").warning("shown")
    logs.stop()
    assert [json.loads(x)["message"] for x in capture.getvalue().splitlines()] == ["shown"]
    with pytest.raises(ValueError, match="xml"):
        logs.setup("router", "xml", stream=capture)


@pytest.mark.parametrize("command", ["up", "gateway", "router", "worker"])
def test_log_format_flag_and_env(command, monkeypatch, capsys):
    assert build_parser().parse_args([command]).log_format == "text"
    assert build_parser().parse_args([command, "--log-format", "json"]).log_format == "json"
    monkeypatch.setenv("PDSERVE_LOG_FORMAT", "json")
    assert build_parser().parse_args([command]).log_format == "json"
    monkeypatch.setenv("PDSERVE_LOG_FORMAT", "yaml")
    with pytest.raises(SystemExit):
        build_parser().parse_args([command])
    assert "PDSERVE_LOG_FORMAT='yaml'" in capsys.readouterr().err


class _StuckSink(io.TextIOBase):
    """A stream whose first write never returns (until released): a pipe nobody reads."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def write(self, s):
        self.entered.set()
        self.release.wait()
        return len(s)


def test_a_stuck_sink_blocks_no_caller_and_counts_the_dropped_lines(capture, monkeypatch):
    from pdserve.services.metrics.common import LOG_LINES_DROPPED
    monkeypatch.setattr(logs, "QUEUE_LINES", 50)
    sink = _StuckSink()
    logs.setup("gateway", "text", stream=sink)
    log = logging.getLogger("pdserve.test")
    before = LOG_LINES_DROPPED._value.get()
    log.info("first")
    assert sink.entered.wait(5)  # the listener is now stuck inside write
    t0 = time.monotonic()
    for i in range(1000):
        log.info("line %d", i)
    took = time.monotonic() - t0
    assert took < 1.0, took  # on the old StreamHandler the first of these never returned
    assert LOG_LINES_DROPPED._value.get() - before == 1000 - 50  # the queue held 50, the rest were dropped
    t0 = time.monotonic()
    logs.stop(timeout=0.2)  # exit does not wait on a stuck sink beyond its bound
    assert time.monotonic() - t0 < 1.0
    sink.release.set()


def test_stop_writes_every_queued_line_and_the_counter_is_exported(capture):
    from prometheus_client import generate_latest

    from pdserve.services.metrics.exposition import exposition
    from pdserve.services.metrics.router import ROUTER
    logs.setup("router", "text", stream=capture)
    for i in range(500):
        logging.getLogger("pdserve.test").warning("w%d", i)
    logs.stop()
    assert len(capture.getvalue().splitlines()) == 500
    assert b"pdserve_log_lines_dropped_total" in generate_latest(exposition(ROUTER, {"model": "m"}))


def test_up_output_and_fd_sinks_never_block_on_a_full_pipe(monkeypatch):
    """`pdserve up` prints through QueuedStream; a sink with a file descriptor is written by os.write, without the
    handler lock `logging.shutdown` takes at exit (a write stuck on the pipe held it, and the process never
    exited)."""
    from pdserve.services.metrics.common import LOG_LINES_DROPPED
    monkeypatch.setattr(logs, "QUEUE_LINES", 20)
    r, w = os.pipe()
    try:
        with os.fdopen(w, "w", closefd=False) as stream:
            out = logs.QueuedStream(stream)
            before = LOG_LINES_DROPPED._value.get()
            t0 = time.monotonic()
            for i in range(100):
                print("x" * 4096, file=out, flush=True)  # 800 KB: the 64 KiB pipe fills within the first lines
            assert time.monotonic() - t0 < 1.0
            assert LOG_LINES_DROPPED._value.get() > before
            sink = out._listener.handlers[0]
            assert isinstance(sink, logs.FdSink) and sink.lock is None  # logging.shutdown cannot wait on it
            t0 = time.monotonic()
            out.stop(timeout=0.2)
            assert time.monotonic() - t0 < 1.0
    finally:
        os.close(r)  # the stuck write ends (EPIPE, ignored)
        os.close(w)


def test_a_library_configuring_logging_at_import_does_not_silence_the_process():
    """nixl calls `logging.config.dictConfig` when it is imported, which closes every handler; once, that ended the
    listener, and a worker (which imports nixl after `logs.setup`) logged nothing after its first line."""
    import subprocess
    import sys
    code = ("import logging; from pdserve.services import logs; logs.setup('worker', 'text'); "
            "logging.getLogger('pdserve.t').warning('before'); import nixl_cu12; "
            "logging.getLogger('pdserve.t').warning('after import'); "
            "import logging.config; logging.config.dictConfig({'version': 1, 'disable_existing_loggers': False}); "
            "logging.getLogger('pdserve.t').warning('after dictConfig')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if " pdserve.t: " in x]
    assert [x.rsplit(": ", 1)[1] for x in lines] == ["before", "after import", "after dictConfig"], r.stderr


def test_up_output_keeps_lines_whole_across_threads():
    """print() writes its text and the newline in two calls; another thread's line between them once glued a
    `PDSERVE_CHILD` announcement onto the end of a restart message, and `UpProcess` missed the restart."""
    buf = io.StringIO()
    out = logs.QueuedStream(buf)
    go = threading.Barrier(2)

    def printer():
        go.wait()
        for i in range(3000):
            print(f"pdserve up: restarted w{i}", file=out, flush=True)

    def announcer():
        go.wait()
        for i in range(3000):
            out.write(f"PDSERVE_CHILD {i}\n")

    threads = [threading.Thread(target=f) for f in (printer, announcer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.stop()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 6000
    glued = [x for x in lines if not re.fullmatch(r"pdserve up: restarted w\d+|PDSERVE_CHILD \d+", x)]
    assert not glued, glued[:3]
