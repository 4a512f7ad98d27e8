"""A worker changes role in its process under load (services/role_switch.py): `pdserve up` with 1 prefill and 2
decode workers, 4 closed-loop clients streaming greedy completions; `pdserve worker-role` switches a decode
worker to prefill, then back. No request fails or changes a token (each stream's text against the offline engine
on the same weights), the registry shows the switch while it runs (what `pdserve status` reads), the worker's
metrics count it, the new role serves (the router's placement names it in that role), and each switch completes
in <= 2 s from the RPC's arrival."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from tests.e2e.conftest import PROMPTS, ROOT, Up, metric

CLIENTS = 4
SWITCH_BOUND_S = 2.0


@pytest.fixture(scope="module")
def up(tiny_llama):
    u = Up(tiny_llama, "--mode", "disagg", "--prefill", "1", "--decode", "2")
    yield u
    u.stop()


def _stream(c: httpx.Client, prompt: str, model: str) -> tuple[int, str, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
    text, route = [], {}
    with c.stream("POST", "/v1/completions", json=body, headers={"x-pdserve-debug": "route"}) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode(), {}
        # the last placement (a refused call's request is placed again: " | " joins them)
        last = r.headers.get("x-pdserve-route", "").split(" | ")[-1]
        route = dict(kv.split("=", 1) for kv in last.split(";") if "=" in kv)
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if "error" in ev:
                    return 599, json.dumps(ev), route
                text.append(ev["choices"][0]["text"])
    return 200, "".join(text), route


def _loop(base: str, model: str, stop: threading.Event, i: int) -> list[tuple[int, str, str, dict, float]]:
    out = []
    with httpx.Client(base_url=base, timeout=30) as c:
        k = i
        while not stop.is_set():
            p = PROMPTS[k % len(PROMPTS)]
            code, text, route = _stream(c, p, model)
            out.append((code, p, text, route, time.monotonic()))
            k += 1
    return out


def _placed_as(up, role: str, wid: str, timeout_s: float = 15.0) -> float | None:
    """When a fresh prompt (no cached prefix draws it elsewhere) was first served with `wid` in `role`."""
    end = time.monotonic() + timeout_s
    with httpx.Client(base_url=up.base_url, timeout=30) as c:
        i = 0
        while time.monotonic() < end:
            code, _, route = _stream(c, f"{os.urandom(6).hex()} {i} fresh prompt", up.info["model"])
            assert code == 200
            if route.get(role) == wid:
                return time.monotonic()
            i += 1
    return None


def _switch(up, worker: dict, role: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "pdserve", "worker-role", f"127.0.0.1:{worker['port']}", role, "--json",
                        "--internal-token-file", up.info["internal_token_file"]],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _registry_roles(up) -> dict[str, tuple[str, str]]:
    from pdserve.services.internal_security import InternalSecurity
    from pdserve.services.redis_conn import RedisAuth
    from pdserve.services.status import from_redis
    st = asyncio.run(from_redis(up.info["redis_url"], up.info["model"],
                                InternalSecurity.from_files(up.info["internal_token_file"]).registry_key(),
                                RedisAuth.from_files(up.info.get("redis_password_file"))))
    return {w["id"]: (w["role"], w["role_switch"]) for w in st["workers"]}


def _watch(up, stop: threading.Event, seen: list) -> None:
    while not stop.is_set():
        seen.append(_registry_roles(up))
        time.sleep(0.01)


def test_switch_under_load_loses_nothing(up, offline_greedy):
    want = {p: t for p, (_, t) in zip(PROMPTS, offline_greedy)}
    victim = up.workers("decode")[1]
    vid = victim["worker_id"]
    # unauthenticated: refused like every internal RPC
    from pdserve.services.pb import worker_pb2, worker_pb2_grpc
    with grpc.insecure_channel(f"127.0.0.1:{victim['port']}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.WorkerStub(ch).SwitchRole(worker_pb2.SwitchRoleRequest(role="prefill"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stop, wstop, seen = threading.Event(), threading.Event(), []
    with cf.ThreadPoolExecutor(CLIENTS + 1) as pool:
        runs = [pool.submit(_loop, up.base_url, up.info["model"], stop, i) for i in range(CLIENTS)]
        time.sleep(1.5)
        watcher = pool.submit(_watch, up, wstop, seen)
        t_decide = time.monotonic()
        to_prefill = _switch(up, victim, "prefill")
        t_switched = time.monotonic()
        wstop.set()
        watcher.result()
        as_prefill = _placed_as(up, "prefill", vid)
        to_decode = _switch(up, victim, "decode")
        as_decode = _placed_as(up, "decode", vid)
        time.sleep(1.0)
        stop.set()
        results = [x for r in runs for x in r.result()]
    print(f"switches: {to_prefill} / {to_decode}; {len(results)} requests")
    bad = [(c, p, t) for c, p, t, _, _ in results if c != 200 or t != want[p]]
    if bad:
        print(f"{len(bad)} bad;", "".join(x for x in up.lines if "WARNING" in x or "ERROR" in x)[-4000:])
    assert len(results) > 20 and not bad, bad[:5]
    for r in (to_prefill, to_decode):
        assert r["switched"] and r["seconds"] <= SWITCH_BOUND_S, r
    # the registry (what `pdserve status` shows) said `switching decode->prefill` while it ran
    assert (("switching", "decode->prefill") in [s.get(vid) for s in seen]), seen[:3]
    assert _registry_roles(up)[vid] == ("decode", "")
    # the new role served: placed as a prefill worker after the first switch, as a decode worker after the second
    assert as_prefill is not None and as_decode is not None, (as_prefill, as_decode)
    print(f"`pdserve worker-role` took {t_switched - t_decide:.2f} s (the switch {to_prefill['seconds']:.2f} s); a "
          f"fresh prompt was served with it as prefill {as_prefill - t_switched:.2f} s after the CLI returned")
    mport = victim["metrics_port"]
    assert metric(mport, "pdserve_role_switches_total", '{from_role="decode",to_role="prefill",outcome="switched"}') == 1
    assert metric(mport, "pdserve_role_switches_total", '{from_role="prefill",to_role="decode",outcome="switched"}') == 1
    assert metric(mport, "pdserve_role_switch_seconds_count") == 2
