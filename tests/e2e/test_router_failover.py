"""No single router: `pdserve up --routers 2` runs two active-active routers and the gateway fails over between
them within a request. Killing one (SIGKILL, under a closed loop of requests) fails none; once it is back, killing
the other fails none either. Before (one router): a probe saw 31 x 503 `no_workers` over ~2.5 s until the router
restarted."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import Up

CLIENTS = 4


@pytest.fixture(scope="module")
def up(tiny_llama):
    u = Up(tiny_llama, "--mode", "disagg", "--routers", "2")
    yield u
    u.stop()


def _loop(base: str, model: str, stop: threading.Event) -> list[int]:
    codes = []
    with httpx.Client(base_url=base, timeout=20) as c:
        while not stop.is_set():
            codes.append(c.post("/v1/completions", json={"model": model, "prompt": "judge my vow",
                                                         "max_tokens": 2}).status_code)
    return codes


def _kill_under_load(up, name: str) -> list[int]:
    stop = threading.Event()
    pid = up.process(name)["pid"]
    with cf.ThreadPoolExecutor(CLIENTS) as pool:
        runs = [pool.submit(_loop, up.base_url, up.info["model"], stop) for _ in range(CLIENTS)]
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        time.sleep(3.0)  # longer than the ~2.5 s one router took to come back
        stop.set()
        codes = [c for r in runs for c in r.result()]
    info = up.wait_restart(name, pid)  # the supervisor restarts it
    _wait_serving(info["port"])  # back: serving again (the next kill must find it there)
    return codes


def _wait_serving(port: int, timeout: float = 30.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    end = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Router"), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"the restarted router on {port} is not serving")


def test_killing_one_router_then_the_other_fails_no_request(up):
    assert [p["name"] for p in up.info["processes"] if p["name"].startswith("router")] == ["router", "router-1"]
    for name in ("router", "router-1"):
        codes = _kill_under_load(up, name)
        print(f"{name} killed: {len(codes)} requests, codes {sorted(set(codes))}")
        if set(codes) != {200}:
            print("".join(x for x in up.lines if "WARNING" in x and "gateway" in x)[-3000:])
        assert len(codes) > 10 and set(codes) == {200}, {c: codes.count(c) for c in set(codes)}
