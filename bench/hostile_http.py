"""Hostile HTTP clients against a running gateway: the figures in docs/reliability.md,
"Hostile input".

    python bench/hostile_http.py --base http://127.0.0.1:8000 [--key sk-...] [--loris 50] [--loris-cap 30]

Reports: the bad-input reproductions (status; whether the keep-alive connection still answers the next request),
slow-loris connections still open over time, whether a 100 KB request head is accepted, and /v1/models latency
idle and while a 1 MB prompt is being tokenized.
"""
from __future__ import annotations

import argparse
import json
import random
import selectors
import socket
import statistics
import string
import threading
import time
from urllib.parse import urlparse

import httpx

BAD = [
    ("/v1/completions", '{"prompt": "hi", "stream_options": 5}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2147483648}'),
    ("/v1/completions", '{"prompt": "ab\\ud800cd"}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "ab\\ud800cd"}]}'),
    ("/v1/completions", '{"prompt": "hi", "stop": "ab\\ud800cd"}'),
    ("/v1/completions", '{"prompt": [true, false]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
]


def bad_inputs(base: str, key: str | None) -> None:
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    with httpx.Client(base_url=base, timeout=30, headers=headers) as c:
        for path, raw in BAD:
            r = c.post(path, content=raw.encode())
            try:
                c.get("/v1/models")
                reuse = "next request ok"
            except httpx.HTTPError as e:
                reuse = f"next request failed ({type(e).__name__})"
            print(f"  {r.status_code} conn={r.headers.get('connection')!s:5} {reuse:32} {raw[:60]}")


def slow_loris(host: str, port: int, n: int, cap: float) -> None:
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n")
        s.setblocking(False)
        socks.append(s)
    t0 = time.monotonic()
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        sel.register(s, selectors.EVENT_READ, i)
    open_ = set(range(n))
    next_drip, marks = t0, [5, 10, 15, 20, 30, 45, 60]
    while open_ and time.monotonic() - t0 < cap:
        if time.monotonic() >= next_drip:
            for i in open_:
                try:
                    socks[i].send(b"x-a: b\r\n")
                except OSError:
                    pass
            next_drip += 2.0
        for k, _ in sel.select(0.1):
            try:
                chunk = socks[k.data].recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                open_.discard(k.data)
                sel.unregister(socks[k.data])
        while marks and time.monotonic() - t0 >= marks[0]:
            print(f"  after {marks.pop(0):>2} s: {len(open_)}/{n} slow-loris connections still open")
    print(f"  at the end ({time.monotonic() - t0:.1f} s): {len(open_)}/{n} open")
    for s in socks:
        s.close()


def big_head(host: str, port: int) -> None:
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nx-big: " + b"a" * (100 << 10) + b"\r\n\r\n")
        try:
            line = s.recv(200).split(b"\r\n")[0].decode()
        except OSError as e:
            line = f"({type(e).__name__})"
    print(f"  100 KB request head: {line or '(closed, no answer)'}")


def models_latency(base: str, key: str | None) -> None:
    r = random.Random(0)
    words = " ".join("".join(r.choices(string.ascii_lowercase, k=r.randint(2, 9))) for _ in range(200_000))
    body = json.dumps({"prompt": words[:1_000_000], "max_tokens": 1})
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    with httpx.Client(base_url=base, timeout=60) as c:
        idle = []
        for _ in range(20):
            t = time.monotonic()
            c.get("/v1/models")
            idle.append(time.monotonic() - t)
        out = {}

        def post():
            t = time.monotonic()
            out["r"] = httpx.post(base + "/v1/completions", content=body, headers=headers, timeout=60)
            out["s"] = time.monotonic() - t

        th = threading.Thread(target=post)
        th.start()
        busy = []
        while th.is_alive():
            t = time.monotonic()
            c.get("/v1/models")
            busy.append(time.monotonic() - t)
            time.sleep(0.02)
        th.join()
    print(f"  /v1/models idle: p50 {statistics.median(idle) * 1e3:.1f} ms, max {max(idle) * 1e3:.1f} ms")
    print(f"  1 MB prompt POST: {out['r'].status_code} in {out['s']:.2f} s; /v1/models meanwhile ({len(busy)} "
          f"requests): p50 {statistics.median(busy) * 1e3:.1f} ms, max {max(busy) * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--key")
    ap.add_argument("--loris", type=int, default=50)
    ap.add_argument("--loris-cap", type=float, default=30.0)
    a = ap.parse_args()
    u = urlparse(a.base)
    print("bad input:")
    bad_inputs(a.base, a.key)
    print("big request head:")
    big_head(u.hostname, u.port)
    print("1 MB prompt:")
    models_latency(a.base, a.key)
    print(f"slow loris ({a.loris} connections, a header line every 2 s):")
    slow_loris(u.hostname, u.port, a.loris, a.loris_cap)


if __name__ == "__main__":
    main()
