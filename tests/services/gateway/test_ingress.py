"""The ingress gate (services/gateway/ingress.py) against a real Redis: the tenants file, 413 / 401, one token
bucket and quota shared by two replicas, a local bucket when Redis is away."""
from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import redis.asyncio as aioredis

from pdserve.services.gateway.ingress import IngressGate
from pdserve.services.gateway.params import APIError
from pdserve.services.gateway.tenants import TenantDirectory
from tests.services._redis import REDIS, cleanup, redis_up, run

pytestmark = pytest.mark.skipif(not redis_up(), reason="needs Redis on 127.0.0.1:6379")


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
        await cleanup(r1, model)

    run(main())


def test_redis_down_degrades_to_local_bucket(keys_file):
    from pdserve.services.metrics import gateway as M

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
