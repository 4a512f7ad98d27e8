"""Ingress gate and admission against a real Redis: token bucket shared by replicas, quota, 413/401, fallback
when Redis is away, reservation leases (expiry frees, recovery after a Redis wipe), queue / degrade / reject."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
import redis.asyncio as aioredis

from pdserve.services.admission import (Admission, AdmissionError, Capacity, OutputPredictor, ReservationLedger,
                                        blocks_for)
from pdserve.services.gateway.ingress import IngressGate
from pdserve.services.gateway.params import APIError
from pdserve.services.gateway.tenants import TenantDirectory

REDIS = "redis://127.0.0.1:6379/0"


def _redis_up() -> bool:
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", 6379)) == 0


pytestmark = pytest.mark.skipif(not _redis_up(), reason="needs Redis on 127.0.0.1:6379")


class FakeRequest:
    def __init__(self, body: bytes = b"{}", headers: dict | None = None, chunked: bool = False):
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}
        if not chunked:
            self.headers.setdefault("content-length", str(len(body)))
        self._body = body

    async def stream(self):
        for i in range(0, len(self._body), 1000):
            yield self._body[i:i + 1000]


@pytest.fixture
def keys_file(tmp_path):
    p = tmp_path / "keys.yaml"
    p.write_text("""
tenants:
  acme: {keys: [sk-acme], rate_rps: 1, burst: 3, priority: 0}
  slowco: {keys: [sk-slow], quota_tokens: 100, quota_window_s: 60}
  docs-a: {keys: [sk-da], shared_namespace: docs}
  docs-b: {keys: [sk-db], shared_namespace: docs}
""")
    return str(p)


def run(coro):
    return asyncio.run(coro)


async def _cleanup(r, model):
    keys = [k async for k in r.scan_iter(f"pdserve:{model}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


def test_tenants_file_keys_and_namespaces(keys_file, tmp_path):
    d = TenantDirectory(keys_file)
    assert d.authenticate("sk-acme").name == "acme" and d.authenticate("nope") is None
    assert d.authenticate(None) is None
    assert d.authenticate("sk-acme").namespace == "tenant:acme"  # own namespace: no cross-tenant prefix hits
    assert d.authenticate("sk-da").namespace == d.authenticate("sk-db").namespace == "docs"  # opt-in sharing
    assert TenantDirectory(None).authenticate(None).name == "default"  # no file: keys optional
    j = tmp_path / "k.json"
    j.write_text(json.dumps({"tenants": {"t": {"keys": "sk-t", "bogus": 1}}}))
    with pytest.raises(ValueError, match="bogus"):
        TenantDirectory(str(j))


def test_body_limit_and_auth(keys_file):
    async def main():
        gate = IngressGate(TenantDirectory(keys_file), None, "m", max_body_bytes=100)
        with pytest.raises(APIError) as e:
            await gate.read_body(FakeRequest(b"x" * 101))
        assert e.value.status == 413
        with pytest.raises(APIError) as e:  # no Content-Length (chunked): cut off at the limit
            await gate.read_body(FakeRequest(b"x" * 5000, chunked=True))
        assert e.value.status == 413
        assert await gate.read_body(FakeRequest(b"x" * 100)) == b"x" * 100
        with pytest.raises(APIError) as e:
            gate.authenticate({"authorization": "Bearer wrong"})
        assert e.value.status == 401
        assert gate.authenticate({"authorization": "Bearer sk-acme"}).name == "acme"
        assert gate.authenticate({"x-api-key": "sk-slow"}).name == "slowco"

    run(main())


def test_two_replicas_share_one_bucket_and_quota(keys_file):
    model = f"t-{uuid.uuid4().hex[:8]}"

    async def main():
        tenants = TenantDirectory(keys_file)
        r1, r2 = aioredis.from_url(REDIS), aioredis.from_url(REDIS)  # two gateway replicas, two connections
        g1, g2 = IngressGate(tenants, r1, model), IngressGate(tenants, r2, model)
        acme = tenants.authenticate("sk-acme")
        ok = 0
        for g in (g1, g2, g1, g2, g1, g2):
            try:
                await g.check_limits(acme)
                ok += 1
            except APIError as e:
                assert e.status == 429 and e.code == "rate_limit_exceeded"
                assert int(e.headers["Retry-After"]) >= 1
        assert ok == 3  # burst 3 across both replicas, not 3 each
        await asyncio.sleep(1.1)  # 1 request/s refills one
        await g2.check_limits(acme)
        # quota: charged by whichever replica finished the request, enforced by both
        slow = tenants.authenticate("sk-slow")
        await g1.check_limits(slow)
        await g1.charge(slow, 60)
        await g2.check_limits(slow)
        await g2.charge(slow, 60)
        with pytest.raises(APIError) as e:
            await g1.check_limits(slow)
        assert e.value.code == "quota_exceeded" and int(e.value.headers["Retry-After"]) > 1
        await r2.aclose()
        await _cleanup(r1, model)

    run(main())


def test_redis_down_degrades_to_local_bucket(keys_file):
    from pdserve.services import metrics as M

    async def main():
        dead = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        gate = IngressGate(TenantDirectory(keys_file), dead, "m")
        acme = gate.tenants.authenticate("sk-acme")
        before = M.INGRESS_DEGRADED._value.get()
        results = []
        for _ in range(4):
            try:
                await gate.check_limits(acme)
                results.append(True)
            except APIError:
                results.append(False)
        assert results == [True, True, True, False]  # still limited, by this replica alone
        assert M.INGRESS_DEGRADED._value.get() - before == 4
        await dead.aclose()

    run(main())


def test_output_predictor_p90():
    p = OutputPredictor(min_samples=20, min_predict=4)
    assert p.predict("t", 100, 500) == 100  # no history: max_tokens
    assert p.predict("t", None, 500) == 500  # no max_tokens: what is left of the context
    for i in range(1, 101):
        p.observe("t", i % 20 + 1)  # outputs of 1..20 tokens
    assert p.p90("t") == 18
    assert p.predict("t", 100, 500) == 18 and p.predict("t", 10, 500) == 10
    assert blocks_for(33, 20, 3, 16) == 3 + 3 * 2 and blocks_for(33, 20, 1, 16, cached_tokens=32) == 1 + 2


CAP = Capacity(blocks=10, seqs=8, block_size=16, max_worker_blocks=10)


async def _cap():
    return CAP


def test_reservation_lease_expiry_frees_and_replicas_share():
    model = f"t-{uuid.uuid4().hex[:8]}"

    async def main():
        r1, r2 = aioredis.from_url(REDIS), aioredis.from_url(REDIS)
        a = ReservationLedger(r1, model, lease_s=0.3)
        b = ReservationLedger(r2, model, lease_s=0.3)
        assert await a.reserve("x", 6, CAP)
        assert not await b.reserve("y", 6, CAP)  # the other replica sees x's blocks
        assert await a.usage() == (6, 1)
        # the replica holding x "crashes": nobody renews, the lease expires, capacity comes back
        await asyncio.sleep(0.4)
        assert await b.reserve("y", 6, CAP)
        assert await b.usage() == (6, 1)
        await b.release("y")
        await b.release("y")  # idempotent
        assert await a.usage() == (0, 0)
        # Redis restarted (ledger wiped): the renew loop writes live reservations back
        assert await a.reserve("z", 4, CAP)
        await r1.delete(a.zkey, a.hkey)
        assert await a.usage() == (0, 0)
        await a.renew({"z": 4})
        assert await b.usage() == (4, 1)
        await a.release("z")
        await r2.aclose()
        await _cleanup(r1, model)

    run(main())


def test_admission_outcomes():
    model = f"t-{uuid.uuid4().hex[:8]}"

    async def main():
        r = aioredis.from_url(REDIS)
        adm = Admission(ReservationLedger(r, model, lease_s=5), _cap, max_queue=1, max_queue_wait_s=0.3)
        far = time.time() + 30
        # can never fit one worker: 400
        with pytest.raises(AdmissionError) as e:
            await adm.admit("big", "t", 16 * 10, 1, 1, 4096, far)
        assert e.value.status == 400 and e.value.state == "REJECTED"
        # 1 prompt block + 4 x 2 output blocks = 9 of 10
        t1 = await adm.admit("a", "t", 10, 20, 4, 4096, far)
        assert (t1.n_granted, t1.blocks, t1.degraded) == (4, 9, False)
        # DEGRADED: n=4 needs 9 blocks, 1 left... n=... nothing fits -> queue; free a, then degrade path
        await adm.release("a")
        t2 = await adm.admit("b", "t", 10, 20, 2, 4096, far)  # 5 blocks
        t3 = await adm.admit("c", "t", 10, 20, 4, 4096, far)  # 9 won't fit in 5 left: n lowered to 2
        assert t3.degraded and t3.n_granted == 2 and t3.states == ["DEGRADED"]
        # full: first waiter queues (QUEUED) and gets in when capacity frees
        waiter = asyncio.create_task(adm.admit("d", "t", 10, 20, 1, 4096, far))
        await asyncio.sleep(0.05)
        # queue (1) full: 503 at once, with Retry-After
        t0 = time.monotonic()
        with pytest.raises(AdmissionError) as e:
            await adm.admit("e", "t", 10, 20, 1, 4096, far)
        assert e.value.status == 503 and e.value.retry_after_s and time.monotonic() - t0 < 0.1
        await adm.release("b")
        t4 = await waiter
        assert t4.states == ["QUEUED"] and t4.queued_s > 0
        # queue deadline: 504 TIMED_OUT
        with pytest.raises(AdmissionError) as e:
            await adm.admit("f", "t", 10, 100, 1, 4096, far)
        assert e.value.status == 504 and e.value.state == "TIMED_OUT"
        for rid in ("c", "d"):
            await adm.release(rid)
        assert await adm.ledger.usage() == (0, 0) and adm.held == {}
        await _cleanup(r, model)

    run(main())
