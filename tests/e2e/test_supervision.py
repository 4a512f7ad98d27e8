"""`pdserve up` supervises its children, on a real disaggregated deployment (Redis, router, one
prefill and one decode worker, gateway; tiny Llama), `--drain-timeout 2` passed to every child:

- a SIGKILLed worker is restarted (new pid, `restarts` counted and announced) and serves again;
- the router, the gateway and a worker each exit within their drain timeout (+ the teardown grace) of a SIGTERM
  while a long stream runs through them, and are restarted;
- `pdserve up` SIGKILLed: every child is gone within a few seconds and its ports are free.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest

from pdserve.services.procutil import EXIT_GRACE_S
from pdserve.services.up_process import UpProcess
from tests.e2e.conftest import NUM_BLOCKS, _env, served_as_ck, wait_until

DRAIN_S = 2.0


@pytest.fixture(scope="module")
def up(tiny_llama, tmp_path_factory):
    model, _ = served_as_ck(tiny_llama, tmp_path_factory, "tenants: {}\n")
    env = _env()
    env["PDSERVE_FAULT_STEP_DELAY_S"] = "0.02"  # every engine step >= 20 ms: a 480-token stream outlasts a drain
    d = UpProcess(["--model", str(model), "--num-gpu-blocks", str(NUM_BLOCKS), "--mode", "disagg", "--prefill", "1",
                   "--decode", "1", "--drain-timeout", str(DRAIN_S), "--threads", "1"], env, 90)
    yield d
    d.stop()


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped by `up` runs nothing and holds no port)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _serves(up) -> bool:
    try:
        r = httpx.post(up.base_url + "/v1/completions", timeout=20, json={
            "model": "ck", "prompt": "judge my vow", "max_tokens": 3, "temperature": 0})
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def _long_stream(up, got_tokens: threading.Event, seen: list) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.stream("POST", up.base_url + "/v1/completions", timeout=60, json={
                    "model": "ck", "prompt": "pack my box", "max_tokens": 480, "ignore_eos": True,
                    "temperature": 0, "stream": True}) as r:
                n = 0
                for line in r.iter_lines():
                    n += line.startswith("data: {")
                    seen[:] = [n]
                    if n >= 3:
                        got_tokens.set()
        except httpx.HTTPError:
            pass
        got_tokens.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_killed_worker_is_restarted_and_serves(up):
    w = dict(up.workers("decode")[0])  # a copy: up.info is updated in place at the restart
    os.kill(w["pid"], signal.SIGKILL)
    new = up.wait_restart(w["name"], w["pid"], 60)
    assert new["restarts"] == 1 and new["last_exit"] == -signal.SIGKILL and new["port"] == w["port"]
    assert any(f"{w['name']}" in line and "exited with signal SIGKILL" in line for line in up.lines)
    assert wait_until(lambda: _serves(up), 60, 0.5), "".join(up.lines[-30:])


@pytest.mark.parametrize("name", ["decode", "gateway", "router"])
def test_sigterm_exits_within_drain_timeout(up, name):
    assert wait_until(lambda: _serves(up), 60, 0.5)
    proc = dict(up.workers("decode")[0] if name == "decode" else up.process(name))  # a copy (see above)
    got, seen = threading.Event(), [0]
    stream = _long_stream(up, got, seen)
    assert got.wait(30) and seen[0] >= 3, seen  # a stream runs through the process
    t0 = time.monotonic()
    os.kill(proc["pid"], signal.SIGTERM)
    assert wait_until(lambda: _gone(proc["pid"]), DRAIN_S + EXIT_GRACE_S + 10, 0.02)
    took = time.monotonic() - t0
    print(f"{name}: exited {took:.2f} s after SIGTERM")
    # the bound the process sets itself is DRAIN_S + EXIT_GRACE_S; 1 s of slack for a loaded box
    assert took <= DRAIN_S + EXIT_GRACE_S + 1.0, f"{name} took {took:.2f} s to exit after SIGTERM"
    stream.join(30)
    up.wait_restart(proc["name"], proc["pid"], 60)
    assert wait_until(lambda: _serves(up), 60, 0.5), "".join(up.lines[-30:])


def test_sigkilled_up_takes_its_children(up):
    procs = list(up.info["processes"])
    assert all(not _gone(p["pid"]) for p in procs)
    os.kill(up.proc.pid, signal.SIGKILL)
    up.proc.wait(10)
    t0 = time.monotonic()
    assert wait_until(lambda: all(_gone(p["pid"]) for p in procs), 5, 0.05), \
        [p["name"] for p in procs if not _gone(p["pid"])]
    ports = [p[k] for p in procs for k in ("port", "metrics_port", "grpc_port") if p.get(k)]

    def free(port: int) -> bool:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    assert wait_until(lambda: all(free(p) for p in ports), 5 - (time.monotonic() - t0) + 1, 0.1), \
        [p for p in ports if not free(p)]
