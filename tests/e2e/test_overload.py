"""Overload and multi-tenancy against a real `pdserve up --mode colocated` (tiny model, small KV pool):
open-loop load at ~3x capacity, two gateway replicas sharing one tenant's bucket through Redis, tenant isolation
of the prefix cache, one billing record per client request, reservations and blocks back to 0."""
from __future__ import annotations

import asyncio
import collections
import re
import subprocess
import sys
import time
import urllib.request

import httpx
import pytest

from tests.e2e.conftest import ROOT, Up, _env, served_as_ck, wait_until

KEYS = """
tenants:
  load: {keys: [sk-load]}
  limited: {keys: [sk-limited], rate_rps: 0.01, burst: 4}
  alice: {keys: [sk-alice]}
  bob: {keys: [sk-bob]}
  docs-a: {keys: [sk-da], shared_namespace: docs}
  docs-b: {keys: [sk-db], shared_namespace: docs}
  ops: {keys: [sk-ops], permissions: [metrics, debug_route]}
"""
BLOCKS = 48  # x 16 tokens; a request below reserves 1 prompt + 7 output blocks -> 6 at once
TIMEOUT = 6.0


def _metrics(port: int) -> str:
    # the gateway's /metrics wants a key with the `metrics` permission; a worker's metrics port ignores it
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer sk-ops"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def _sum(text: str, name: str, where: str = "") -> float:
    return sum(float(m.group(2)) for m in re.finditer(rf"^{name}(\{{[^}}]*\}})?\s+(\S+)$", text, re.M)
               if where in (m.group(1) or ""))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@pytest.fixture(scope="module")
def up(tiny_llama, tmp_path_factory):
    model, keys = served_as_ck(tiny_llama, tmp_path_factory, KEYS)
    # --threads 1: the worker leaves a core to the gateway and the load generator (2-core CI boxes)
    d = Up(model, "--mode", "colocated", "--workers", "1", "--num-gpu-blocks", str(BLOCKS), "--threads", "1",
           "--api-keys-file", str(keys), "--admission-queue", "3", "--max-queue-wait", "2",
           "--default-timeout", str(TIMEOUT))
    d.keys = keys
    d.model = model
    yield d
    assert d.stop() == 0


def _post(base, key, **body):
    body.setdefault("model", "ck")
    return httpx.post(base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_ingress_rejections(up):
    assert _post(up.base_url, "wrong", prompt="hi", max_tokens=2).status_code == 401
    r = httpx.post(up.base_url + "/v1/completions", content=b"x" * (2 << 20), timeout=10,
                   headers={"Authorization": "Bearer sk-load", "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = _post(up.base_url, "sk-load", prompt=[5 + i % 300 for i in range(BLOCKS * 16 + 66)], max_tokens=2)  # > KV
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_metrics_and_route_debug_are_per_tenant_permissions(up):
    """/metrics lists every tenant's name and counts, and the route header names workers."""
    m = up.base_url + "/metrics"
    # a tenant's own request first: the per-tenant series exist once one was billed (not whatever ran before)
    r = httpx.post(up.base_url + "/v1/completions", json={"model": "ck", "prompt": "hi", "max_tokens": 1},
                   headers={"Authorization": "Bearer sk-alice"}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(m).status_code == 401
    r = httpx.get(m, headers={"Authorization": "Bearer sk-alice"})
    assert r.status_code == 403 and "tenant=" not in r.text
    assert wait_until(lambda: 'tenant="alice"' in httpx.get(m, headers={"Authorization": "Bearer sk-ops"}).text, 10)
    for key, shown in (("sk-alice", False), ("sk-ops", True)):
        r = httpx.post(up.base_url + "/v1/completions", json={"model": "ck", "prompt": "hi", "max_tokens": 1},
                       headers={"Authorization": f"Bearer {key}", "x-pdserve-debug": "route"}, timeout=30)
        assert r.status_code == 200, r.text
        assert ("x-pdserve-route" in r.headers) == shown, (key, dict(r.headers))
    assert "mode=colocated" in r.headers["x-pdserve-route"]


def test_tenant_isolation_of_prefix_cache(up):
    prompt = list(range(10, 80))  # 4 full blocks

    def cached(key):
        r = _post(up.base_url, key, prompt=prompt, max_tokens=2, temperature=0)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("sk-alice") == 0
    assert cached("sk-alice") > 0  # same tenant: hit
    assert cached("sk-bob") == 0  # other tenant, same tokens: never a hit
    assert cached("sk-da") == 0
    assert cached("sk-db") > 0  # both opted into the shared namespace "docs"


def test_two_gateway_replicas_share_a_tenant_bucket(up):
    from pdserve.services.ports import free_port
    router = up.process("router")["port"]
    port = free_port()
    g2 = subprocess.Popen([sys.executable, "-m", "pdserve", "gateway", "--model", str(up.model), "--port", str(port),
                           "--router", f"127.0.0.1:{router}", "--redis-url", up.info["redis_url"],
                           "--api-keys-file", str(up.keys), *up.security_flags()], env=_env(), cwd=str(ROOT))
    try:
        base2 = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _ok(base2 + "/health"), 30)
        codes = [_post(b, "sk-limited", prompt="hi", max_tokens=1).status_code
                 for b in (up.base_url, base2) * 3]
        assert sorted(codes) == [200] * 4 + [429] * 2, codes  # burst 4 in all, not 4 per replica
        r = _post(base2, "sk-limited", prompt="hi", max_tokens=1)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        g2.terminate()
        g2.wait(15)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def _one(client, base, t_sched, results, **body):
    delay = t_sched - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    t0 = time.monotonic()
    try:
        r = await client.post(base + "/v1/completions", json={"model": "ck", **body},
                              headers={"Authorization": "Bearer sk-load"})
        code, err = r.status_code, (r.json().get("error") or {}).get("code") if r.status_code != 200 else None
    except httpx.HTTPError as e:
        code, err = -1, repr(e)
    # latency from the scheduled send time (no coordinated omission) and from the actual send
    results.append((code, err, time.monotonic() - t_sched, time.monotonic() - t0))


async def _load(base, rate, duration, body):
    results: list = []
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        start = time.monotonic() + 0.05
        n = int(rate * duration)
        await asyncio.gather(*[_one(client, base, start + i / rate, results, **body) for i in range(n)])
    return results


# 112 tokens, not 40: at 40 an AMX Xeon served 6 at once in 0.12 s (48 req/s), so the generator's 90 req/s cap
# overloaded nothing and no request was rejected
BODY = dict(prompt=list(range(20, 32)), max_tokens=112, ignore_eos=True, temperature=0)


def test_open_loop_overload(up):
    worker = up.workers()[0]
    # capacity: 6 concurrent requests (KV reservations); measure how long a full batch of them takes. The median
    # of three batches after a warm-up one: a single batch's time varied ~2x between runs, and an overstated
    # capacity offers the box far more than 3x (one run under a CPU hog: "capacity" 22 req/s, offered 66)
    asyncio.run(_load(up.base_url, 1000, 0.006, BODY))  # warm-up
    batches = []
    for _ in range(3):
        t0 = time.monotonic()
        calib = asyncio.run(_load(up.base_url, 1000, 0.006, BODY))
        batches.append(time.monotonic() - t0)
        assert [c for c, *_ in calib] == [200] * 6, calib
    capacity = 6 / sorted(batches)[1]
    rss0 = _rss_mb(worker["pid"])
    gw0 = _metrics(up.port)
    rate = min(3 * capacity, 90.0)
    res = asyncio.run(_load(up.base_url, rate, 6.0, {**BODY, "timeout": TIMEOUT}))
    codes = [c for c, *_ in res]
    ok = [r for r in res if r[0] == 200]
    rejected = [r for r in res if r[0] in (429, 503)]
    timed_out = [r for r in res if r[0] == 504]
    summary = (f"capacity {capacity:.1f} req/s, offered {rate:.1f} req/s, {len(res)} requests: {len(ok)} ok, "
               f"{len(rejected)} rejected, {len(timed_out)} timed out, other {set(codes) - {200, 429, 503, 504}}; "
               f"ok latency max {max((r[2] for r in ok), default=0):.2f} s, reject latency max "
               f"{max((r[3] for r in rejected), default=0) * 1000:.0f} ms")
    lat = sorted(r[3] for r in rejected)
    gw = _metrics(up.port)
    srv = {le: _sum(gw, "pdserve_rejection_latency_seconds_bucket", f'le="{le}"')
           - _sum(gw0, "pdserve_rejection_latency_seconds_bucket", f'le="{le}"') for le in ("0.01", "0.1", "+Inf")}
    summary += f"; rejected as {dict(collections.Counter(r[1] for r in rejected))}"
    if lat:
        summary += (f"; reject latency at the client p50 {lat[len(lat) // 2] * 1000:.0f} ms p95 "
                    f"{lat[int(len(lat) * .95)] * 1000:.0f} ms")
    summary += f"; at the gateway <=10ms/<=100ms/all {srv}"
    print(summary)
    assert set(codes) <= {200, 503, 504}, summary
    assert ok and rejected, summary  # it really was overloaded, and it still served
    assert all(r[2] <= TIMEOUT + 0.5 for r in ok), summary  # admitted ones finished within their deadline
    # the rejected were told within 100 ms: 95% of them at the gateway (arrival -> response written), as
    # test_deadline_admission holds it (one CI run had 104 of 109 within 100 ms, the slowest at 146 ms, the box
    # relaying 3x its capacity of streams on two cores), and every rejection counted there. The client measure
    # includes the load generator's own scheduling on the same two cores, so only its median is asserted (its p95
    # is printed: 95-240 ms seen on a loaded 2-core box, 65 ms on a quiet one)
    assert srv["+Inf"] >= len(rejected) and srv["0.1"] >= 0.95 * srv["+Inf"], summary
    assert lat[len(lat) // 2] <= 0.1, summary
    assert all(r[1] == "timeout" and r[2] <= TIMEOUT + 0.5 for r in timed_out), summary
    # afterwards: blocks and reservations back to 0, worker memory bounded, one billing record per request
    r = up.redis()
    assert wait_until(lambda: r.zcard("pdserve:ck:reservations") == 0 and r.hlen("pdserve:ck:reservation_blocks") == 0,
                      10), "reservations left behind"
    wm = worker["metrics_port"]
    assert wait_until(lambda: _sum(_metrics(wm), "pdserve_kv_blocks_in_use") == 0, 10)
    assert _rss_mb(worker["pid"]) - rss0 < 150
    gw1 = _metrics(up.port)
    records = _sum(gw1, "pdserve_usage_records_total", 'tenant="load"') - _sum(gw0, "pdserve_usage_records_total",
                                                                               'tenant="load"')
    assert records == len(res), (records, len(res))
    assert _sum(gw1, "pdserve_requests_terminal_total", 'state="REJECTED"') >= len(rejected)
    states = _metrics(wm)
    assert _sum(states, "pdserve_request_state_entries_total", 'state="RUNNABLE"') > 0
    assert _sum(states, "pdserve_requests_in_state", 'state="DECODING"') == 0
