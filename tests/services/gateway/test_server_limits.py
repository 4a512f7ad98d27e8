"""Slow clients, big heads, big prompts and 5xx answers against a real gateway HTTP server on loopback:
`pdserve gateway` as a process (uvicorn with the gateway's protocol and limits), raw sockets for what an HTTP
client library would not send.

Its router address is a closed port: nothing here needs a worker.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import selectors
import socket
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdserve.services.ports import free_port

ROOT = Path(__file__).resolve().parents[3]
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
KEYS = "tenants:\n  plain: {keys: [sk-plain]}\n"
TOKEN = "internal-token-for-the-planner-0123456789"


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, "gateway exited"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(KEYS)
    token = keys.parent / "token"
    token.write_text(TOKEN)
    port, mport = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "gateway", "--model", "builtin", "--port", str(port),
         "--router", "127.0.0.1:1", "--api-keys-file", str(keys), "--header-timeout", str(HEADER_TIMEOUT),
         "--body-timeout", str(BODY_TIMEOUT), "--max-header-bytes", str(16 << 10), "--metrics-port", str(mport),
         "--internal-token-file", str(token)],
        env=env, cwd=str(ROOT))
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
        yield port, mport
    finally:
        proc.terminate()
        proc.wait(10)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_until_closed(s: socket.socket, timeout: float = 10, on_data=None) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed it (monotonic). A reset
    counts as the close: a client still sending when the server closes gets an RST after the server's answer."""
    s.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return data, time.monotonic()
        if not chunk:
            return data, time.monotonic()
        data += chunk
        if on_data is not None:
            on_data()


def _get_models(s: socket.socket) -> bytes:
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
    s.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    return data


def _watch_until_closed(socks: list[socket.socket], timeout: float = 10) -> tuple[list[float], list[bytes]]:
    """When the server closed each socket (monotonic), and what it sent first, watching all at once."""
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    closed: list[float] = [float("inf")] * len(socks)
    data: list[bytes] = [b""] * len(socks)
    end = time.monotonic() + timeout
    left = len(socks)
    while left and time.monotonic() < end:
        for key, _ in sel.select(0.05):
            i = key.data
            try:
                chunk = socks[i].recv(65536)
            except ConnectionResetError:  # closed with our trickled bytes unread: closed all the same
                chunk = b""
            if chunk:
                data[i] += chunk
                continue
            closed[i] = time.monotonic()
            sel.unregister(socks[i])
            left -= 1
    sel.close()
    return closed, data


def test_slow_loris_connections_are_closed_within_the_header_timeout(gateway):
    port, _ = gateway
    silent = [_connect(port) for _ in range(10)]  # connect, send nothing
    trickle = [_connect(port) for _ in range(10)]  # a request head, one header line every 0.2 s
    t0 = time.monotonic()
    for s in trickle:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
    stop = threading.Event()

    def drip():
        while not stop.wait(0.2):
            for s in trickle:
                try:
                    s.send(b"x-a: b\r\n")
                except OSError:  # closed by the server, or its buffer full: either way, done with it
                    pass

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        with _connect(port) as ok:  # meanwhile the server serves others
            assert _get_models(ok).startswith(b"HTTP/1.1 200")
        closed, replies = _watch_until_closed(silent + trickle)
    finally:
        stop.set()
        dripper.join()
        for s in silent + trickle:
            s.close()
    held = sorted(c - t0 for c in closed)
    assert held[0] >= HEADER_TIMEOUT * 0.8 and held[-1] < HEADER_TIMEOUT + 2.0, held  # was: all open after 40 s
    assert all(r.startswith(b"HTTP/1.1 408") for r in replies if r), replies


def test_a_body_sent_too_slowly_is_408_and_closes(gateway):
    port, _ = gateway
    with _connect(port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer sk-plain\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"")
        t0 = time.monotonic()
        stop = threading.Event()

        def drip():
            while not stop.is_set():
                try:
                    s.sendall(b"a")
                except OSError:
                    return
                time.sleep(0.1)

        th = threading.Thread(target=drip)
        th.start()
        try:
            data, at = _read_until_closed(s, on_data=stop.set)  # the answer is out: stop sending
        finally:
            stop.set()
            th.join()
    assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data and b"connection: close" in data.lower()
    assert BODY_TIMEOUT * 0.8 <= at - t0 < BODY_TIMEOUT + 2.0


def test_oversized_headers_are_refused(gateway):
    port, _ = gateway
    with _connect(port) as s:  # in one piece: whether h11 (incomplete) or the guard (whole) refuses it, it is a 431
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nx-big: " + b"a" * (100 << 10) + b"\r\n\r\n")
        data, _ = _read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 431") and b"connection: close" in data.lower()
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_header_fields_too_large"
    with _connect(port) as s:  # in pieces: h11 refuses the incomplete head once it passes the limit
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")
        try:
            for _ in range(40):
                s.sendall(b"x-more: " + b"b" * 1000 + b"\r\n")
                time.sleep(0.005)
        except OSError:  # already refused and closed
            pass
        try:
            data, _ = _read_until_closed(s)
        except ConnectionResetError:
            data = b""
    assert data == b"" or data.startswith(b"HTTP/1.1 431"), data[:200]  # b"": reset while the client still sent
    with _connect(port) as s:  # in pieces that stop just past the limit: h11 refuses it incomplete, with the 431
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")
        for _ in range((16 << 10) // 1008 + 1):
            s.sendall(b"x-more: " + b"b" * 998 + b"\r\n")
            time.sleep(0.005)
        data, _ = _read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 431") and b"connection: close" in data.lower(), data[:200]  # was uvicorn's 400
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_header_fields_too_large"
    with _connect(port) as s:  # headers under the limit, split across reads, on a kept-alive connection
        for _ in range(2):
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")
            time.sleep(0.3)
            assert _get_models_rest(s).startswith(b"HTTP/1.1 200")


def _get_models_rest(s: socket.socket) -> bytes:
    s.sendall(b"x-ok: " + b"c" * 8000 + b"\r\n\r\n")
    data = b""
    while not data.endswith(b"}"):
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    return data


def test_models_stays_fast_while_a_1mb_prompt_is_tokenized(gateway):
    port, _ = gateway
    r = random.Random(0)
    words = " ".join("".join(r.choices(string.ascii_lowercase, k=r.randint(2, 9))) for _ in range(200_000))
    body = {"prompt": words[:1_000_000], "max_tokens": 1}
    result: dict = {}

    def post():
        t = time.monotonic()
        result["r"] = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60,
                                 headers={"Authorization": "Bearer sk-plain"})
        result["s"] = time.monotonic() - t

    th = threading.Thread(target=post)
    lat = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        c.get("/v1/models")
        th.start()
        while th.is_alive():
            t = time.monotonic()
            assert c.get("/v1/models").status_code == 200
            lat.append(time.monotonic() - t)
            time.sleep(0.02)
    th.join()
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    # On the event loop the tokenizer held every other request for the whole of it (1.8 s for this prompt).
    assert len(lat) >= 3 and max(lat) < 0.5 * result["s"], (result["s"], lat)


def test_metrics_need_a_permission_on_the_api_port_and_none_on_the_metrics_port(gateway):
    port, mport = gateway
    assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 401
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer sk-plain"})
    assert r.status_code == 403
    assert "pdserve_" in httpx.get(f"http://127.0.0.1:{mport}/metrics").text


def test_the_internal_token_reads_the_api_ports_metrics_for_the_local_planner(gateway):
    """With API keys on, `up --planner` scraped the gateway's /metrics without a key (401) and sized its pools with
    no request rate; it now sends the deployment's internal token, which the gateway takes for /metrics only."""
    from pdserve.planner import scrape
    port, _ = gateway
    url = f"http://127.0.0.1:{port}/metrics"
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "builtin", "prompt": "a"},
                   headers={"Authorization": "Bearer sk-plain"})
    assert r.status_code == 503  # no router: a terminal request the gateway counts
    assert httpx.get(url, headers={"Authorization": f"Bearer {TOKEN[:-1]}x"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert scrape.fetch([url]).finished == 0  # refused: nothing seen
    assert scrape.fetch([url], bearer=TOKEN).finished >= 1
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "builtin", "prompt": "a"},
                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 401  # the token is no API key: it reads metrics, it does not serve requests


def test_an_unhandled_error_is_a_500_that_closes_the_connection():
    """Any exception nothing handles: a 500 with `Connection: close` and no internals, then the server closes
    the connection in order (EOF, not a reset), so a keep-alive client does not send its next request into it."""
    import uvicorn

    from pdserve.services.gateway.app import GatewayConfig, create_gateway
    from pdserve.services.gateway.server import listen_socket, uvicorn_config

    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    box: dict = {}

    def serve():
        async def main():
            gw = create_gateway(GatewayConfig("builtin", "builtin", "127.0.0.1:1"))
            app = gw.app

            @app.get("/boom")
            async def boom():
                raise RuntimeError("worker decode-0 at 10.9.8.7:7100: /project/cpp/x.cc:12")

            box["server"] = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, gw.config))
            await box["server"].serve(sockets=[sock])

        asyncio.run(main())

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        end = time.monotonic() + 30
        while not (box.get("server") and box["server"].started) and time.monotonic() < end:
            time.sleep(0.05)
        with _connect(port) as s:
            assert _get_models(s).startswith(b"HTTP/1.1 200")  # a kept-alive connection ...
            s.sendall(b"GET /boom HTTP/1.1\r\nHost: localhost\r\n\r\n")  # ... then the failure on it
            data, _ = _read_until_closed(s)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 500") and b"connection: close" in head.lower(), head
        assert b"internal_error" in body and b"request id req-" in body
        for secret in (b"10.9.8.7", b"/project", b"decode-0", b"RuntimeError"):
            assert secret not in data
        with _connect(port) as s:  # the server itself is fine
            assert _get_models(s).startswith(b"HTTP/1.1 200")
    finally:
        if box.get("server"):
            box["server"].should_exit = True
        th.join(10)
