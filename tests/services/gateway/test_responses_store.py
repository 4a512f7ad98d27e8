"""Stored responses for `previous_response_id` (gateway/responses_api/store.py) against a real redis-server:
the conversation comes back for the tenant that made it and for no other, with its expiry set; a tenant's count
and an entry's size are bounded; an id that is not one of ours is a 400 before Redis is asked; Redis down is
`store: false` on writing and a 503 on reading, never a 500."""
from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
import redis.asyncio as aioredis

from pdserve.services.gateway.params import APIError
from pdserve.services.gateway.responses_api import store as S
from pdserve.services.ports import free_port

RID = "resp_" + "a" * 24
ITEMS = [{"role": "user", "content": "hi"}, {"type": "message", "id": "msg_1", "status": "completed",
                                             "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]}]


@pytest.fixture
def redis_port(tmp_path):
    import redis
    port = free_port()
    p = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                          "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            redis.Redis(port=port).ping()
            break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    yield port
    p.kill()
    p.wait()


def _run(port: int, body):
    async def main():
        r = aioredis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return await body(S.ResponseStore(r, "m"), r)
        finally:
            await r.aclose()
    return asyncio.run(main())


def test_a_stored_conversation_comes_back_for_its_tenant_only(redis_port):
    async def body(st, r):
        assert await st.save("alice", RID, ITEMS)
        assert await st.load("alice", RID) == ITEMS
        ttl = await r.ttl(f"pdserve:m:responses:entry:alice:{RID}")
        assert S.TTL_S - 5 <= ttl <= S.TTL_S
        with pytest.raises(APIError) as e:
            await st.load("bob", RID)
        assert e.value.status == 400 and e.value.param == "previous_response_id"
    _run(redis_port, body)


def test_bounded_per_tenant_and_per_entry(redis_port, monkeypatch):
    monkeypatch.setattr(S, "MAX_PER_TENANT", 3)
    monkeypatch.setattr(S, "MAX_BYTES", 200)
    ids = [f"resp_{i:024x}" for i in range(5)]

    async def body(st, r):
        for rid in ids:
            assert await st.save("alice", rid, ITEMS)
            await asyncio.sleep(0.01)  # distinct scores: the order of saving
        assert await st.save("bob", ids[0], ITEMS)  # another tenant's count is its own
        kept = [rid for rid in ids if await r.exists(f"pdserve:m:responses:entry:alice:{rid}")]
        assert kept == ids[2:]  # the oldest went first
        assert await r.zcard("pdserve:m:responses:index:alice") == 3
        assert await st.load("bob", ids[0]) == ITEMS
        assert not await st.save("alice", "resp_" + "b" * 24, [{"role": "user", "content": "x" * 300}])
    _run(redis_port, body)


@pytest.mark.parametrize("rid", ["resp_1", "x" * 40, "resp_" + "A" * 24, 7, "resp_" + "a" * 24 + ":*"])
def test_an_id_that_is_not_ours_is_a_400(rid):
    async def main():
        with pytest.raises(APIError) as e:
            await S.ResponseStore(None, "m").load("alice", rid)  # no Redis call: None would raise
        assert e.value.status == 400 and e.value.param == "previous_response_id"
    asyncio.run(main())


def test_redis_down_is_unstored_on_write_and_503_on_read():
    async def main():
        r = aioredis.Redis(port=free_port(), socket_timeout=0.3, socket_connect_timeout=0.3)
        st = S.ResponseStore(r, "m")
        assert await st.save("alice", RID, ITEMS) is False
        with pytest.raises(APIError) as e:
            await st.load("alice", RID)
        assert e.value.status == 503 and e.value.code == "store_unavailable"
        await r.aclose()
    asyncio.run(main())
