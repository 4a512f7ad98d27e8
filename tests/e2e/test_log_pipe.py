"""A deployment whose output nobody reads keeps serving.

`pdserve up` under a supervisor that never reads its stdout / stderr: the pipe fills (64 KiB) and every write to
it blocks. Before, the gateway's event loop blocked inside `logging.StreamHandler.emit` once it was full and every
request hung. Now each process logs through a bounded queue (logs.py): the lines that do not fit are dropped and
counted (`pdserve_log_lines_dropped_total`), and requests keep being answered."""
from __future__ import annotations

import concurrent.futures as cf
import fcntl
import os
import signal
import subprocess
import sys
import termios
import time

import httpx

from pdserve.services.up import free_port
from tests.e2e.conftest import _env, samples

REQUESTS = 1000
COMPLETIONS = 100  # of them; the rest GET /v1/models


def _buffered(fd: int) -> int:
    """Bytes written to the pipe and not read."""
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)


def _wait_health(base: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, "pdserve up exited"
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("not healthy")


def _request(client: httpx.Client, i: int) -> int:
    if i % (REQUESTS // COMPLETIONS) == 0:
        return client.post("/v1/completions", json={"model": "builtin", "prompt": "hi", "max_tokens": 1}).status_code
    return client.get("/v1/models").status_code


def test_a_deployment_whose_output_nobody_reads_keeps_serving():
    port = free_port()
    r, w = os.pipe()  # the read end stays open and is never read: writers block, nobody gets EPIPE
    # DEBUG: every request writes a few lines, so the 64 KiB fill early; a small queue fills soon after
    env = {**_env(), "PDSERVE_LOG_LEVEL": "DEBUG", "PDSERVE_LOG_QUEUE_LINES": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--model", "builtin", "--mode", "colocated",
                             "--workers", "1", "--port", str(port)], env=env, stdout=w, stderr=w,
                            start_new_session=True)
    os.close(w)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_health(base, proc)
        t0 = time.monotonic()
        with httpx.Client(base_url=base, timeout=10) as client, cf.ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda i: _request(client, i), range(REQUESTS)))
        took = time.monotonic() - t0
        assert codes.count(200) == REQUESTS, {c: codes.count(c) for c in set(codes)}
        # the pipe really is full (before: the requests hung from here on). Linux counts a pipe in 16 pages of
        # 4 KiB and appends a write to the last page only when all of it fits, so a full pipe holds up to one line
        # less per page: 61,095 bytes in one CI run
        assert _buffered(r) >= 48 << 10  # lines here are under 1 KiB
        dropped = samples(httpx.get(base + "/metrics", timeout=10).text, "pdserve_log_lines_dropped_total")
        assert dropped and dropped[0] > 0, dropped  # the gateway dropped lines rather than wait for the pipe
        print(f"{REQUESTS} requests in {took:.2f} s with the output pipe full; gateway dropped {dropped[0]:.0f} "
              f"log lines")
        assert httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        t_stop = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # up's signal handler still runs: its own lines are queued too
        try:
            code = proc.wait(45)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
        stop_s = time.monotonic() - t_stop
        os.close(r)
    assert code == 0  # up stopped its children and exited although nobody read its output
    # redis-server writes its shutdown lines in blocking writes: with the pipe as its stdout it hung at exit until
    # up's 15 s SIGKILL; its output now goes through up's queued log
    print(f"stopped in {stop_s:.1f} s")
    assert stop_s < 10, stop_s
