"""A client that stops reading, over real sockets (`pdserve up --mode colocated`, one worker).

The slow client's stream must back up through every buffer between it and the engine (its small receive
buffer, the gateway's bounded send buffer and asyncio write buffer, the gRPC stream window) into the worker's
bounded per-request queue, which pauses the request (BACKPRESSURED), and past `backpressure_preempt_s` (5 s)
preempts it. Meanwhile another stream keeps its pace; once the slow client reads again it gets the whole,
correct answer.
"""
from __future__ import annotations

import json
import shutil
import socket
import statistics
import time

import httpx
import pytest

from tests.e2e.conftest import Up, metric, wait_until

SLOW_TOKENS = 400
# top_logprobs makes every chunk ~1.7 KB of SSE and ~0.5 KB of gRPC, so 400 tokens (~680 KB) overflow every
# bounded buffer in front of the engine (~64 KB each) well before the request is done
SLOW_BODY = {"model": "ck", "messages": [{"role": "user", "content": "judge my vow"}], "max_tokens": SLOW_TOKENS,
             "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}


@pytest.fixture(scope="module")
def up(tiny_llama):
    model = tiny_llama.parent / "ck"
    if not model.exists():
        shutil.copytree(tiny_llama, model)
    d = Up(model, "--mode", "colocated", "--workers", "1", "--threads", "1")
    yield d
    d.stop()


def _entries(port: int, state: str) -> float:
    return metric(port, "pdserve_request_state_entries_total", f'{{state="{state}"}}')


def _open_slow_stream(port: int) -> socket.socket:
    """A raw HTTP/1.1 streaming request on a socket with a tiny receive buffer, and nothing read yet."""
    body = json.dumps({**SLOW_BODY, "stream": True, "stream_options": {"include_usage": True}}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: sets the advertised window
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


def _read_sse(s: socket.socket, timeout: float = 60.0) -> list[dict]:
    """Read the chunked response to `data: [DONE]` and return the JSON events."""
    s.settimeout(timeout)
    raw = b""
    while b"data: [DONE]" not in raw:
        c = s.recv(1 << 16)
        assert c, "connection closed before [DONE]"
        raw += c
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    body = b""
    while rest:  # de-chunk (Transfer-Encoding: chunked)
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        body, rest = body + rest[:n], rest[n + 2:]
    return [json.loads(e[6:]) for e in body.decode().split("\n\n") if e.startswith("data: {")]


def _stream_itls(base_url: str, n: int) -> tuple[list[float], str]:
    gaps, text, last = [], "", None
    with httpx.stream("POST", base_url + "/v1/completions", timeout=30, json={
            "model": "ck", "prompt": "the quick brown fox", "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])
                if ch["choices"] and ch["choices"][0]["text"]:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    text += ch["choices"][0]["text"]
    return gaps, text


def test_slow_reader_backpressures_worker_not_others(up):
    w = up.workers()[0]["metrics_port"]
    r = httpx.post(up.base_url + "/v1/chat/completions", json=SLOW_BODY, timeout=60)
    assert r.status_code == 200, r.text
    ref = r.json()
    ref_text = ref["choices"][0]["message"]["content"]
    assert ref["usage"]["completion_tokens"] == SLOW_TOKENS
    base_gaps, base_text = _stream_itls(up.base_url, 40)  # the normal stream's pace on an idle worker
    bp0, pre0 = _entries(w, "BACKPRESSURED"), _entries(w, "PREEMPTED")

    s = _open_slow_stream(up.port)
    try:
        # backpressure reaches the engine: the request is paused on the worker
        assert wait_until(lambda: _entries(w, "BACKPRESSURED") > bp0, 15), "slow request never BACKPRESSURED"
        # another client streams at its normal pace meanwhile
        gaps, text = _stream_itls(up.base_url, 40)
        assert text == base_text and len(gaps) == len(base_gaps)
        med, base_med = statistics.median(gaps), statistics.median(base_gaps)
        assert med <= max(3 * base_med, base_med + 0.05), (med, base_med)
        assert max(gaps) < 1.0, max(gaps)
        # a reader that stays away past backpressure_preempt_s gives its KV back (preempted, not failed)
        assert wait_until(lambda: _entries(w, "PREEMPTED") > pre0, 12), "paused request was not preempted"
        events = _read_sse(s)  # the client reads again
    finally:
        s.close()
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    usage = next(e["usage"] for e in events if e.get("usage"))
    assert usage["completion_tokens"] == SLOW_TOKENS
    assert text == ref_text  # whole and correct after pause, preemption and recompute
    assert wait_until(lambda: metric(w, "pdserve_kv_blocks_in_use") == 0, 10)
