"""Usage records opened at admission and closed at the end (gateway/usage_ledger.py), on real Redis: a dead
replica's open records are finalised once, by whichever live replica claims them first; an owner presumed dead
does not write a second one; a record Redis lost is still written by its owner."""
import asyncio
import time
import uuid

import redis.asyncio as aredis

from pdserve.services.gateway.usage_ledger import LIVE_TTL_S, OpenUsage, UsageLedger

REDIS = "redis://127.0.0.1:6379/0"


def _u(ledger: UsageLedger, i: int, prompt: int = 7) -> OpenUsage:
    return OpenUsage(f"u{i}-{uuid.uuid4().hex[:6]}", f"cmpl-{i}", f"x-{i}", "t1", ledger.model, prompt, time.time(),
                     None, ledger.replica)


def _run(body):
    async def main():
        r = aredis.Redis.from_url(REDIS)
        model = f"test-usage-{uuid.uuid4().hex[:8]}"
        try:
            await body(r, model)
        finally:
            async for k in r.scan_iter(f"pdserve:{model}:*"):
                await r.delete(k)
            await r.aclose()
    asyncio.run(main())


def test_dead_replica_records_are_finalised_exactly_once():
    async def body(r, model):
        written: dict[str, list] = {"a": [], "b": [], "c": []}
        a, b, c = (UsageLedger(r, model, lambda rec, u, k=k: written[k].append((rec, u))) for k in "abc")
        us = [_u(a, i) for i in range(40)]
        for u in us:
            assert await a.open(u)
        assert await a.close(us[0].usage_id)  # ended on a: a writes it
        await b.refresh()
        await c.refresh()
        assert await b.finalise_dead() == 0  # a is live: nothing to finalise
        await asyncio.sleep(LIVE_TTL_S + 0.2)  # a stops refreshing (SIGKILL): its liveness lapses
        await b.refresh()
        await c.refresh()
        nb, nc = await asyncio.gather(b.finalise_dead(), c.finalise_dead())  # two finalisers race
        assert nb + nc == 39
        recs = [x for k in "bc" for x in written[k]]
        assert sorted(u.usage_id for _, u in recs) == sorted(u.usage_id for u in us[1:])  # each once
        rec, u = recs[0]
        assert rec.state == "FAILED" and rec.finalised_by in (b.replica, c.replica)
        assert rec.billed_tokens == rec.prompt_tokens == 7 and rec.request_id == u.request_id
        assert rec.tenant == "t1" and a.replica in rec.error
        line = rec.to_json()  # the JSON line's fields, as the owner's record has them
        assert line["billed_tokens"] == 7 and line["emitted_tokens"] == 0 and line["times"]["admitted"] is None
        assert await b.finalise_dead() + await c.finalise_dead() == 0  # nothing twice
        # a was only presumed dead (SIGSTOP): its own close of a finalised record must not write a second one
        assert not await a.close(us[1].usage_id)
        # and a dead replica with nothing left open is forgotten
        assert a.replica.encode() not in await r.smembers(f"pdserve:{model}:usage:replicas")
    _run(body)


def test_record_lost_by_redis_is_written_by_its_owner_and_reopened():
    async def body(r, model):
        a = UsageLedger(r, model, lambda rec, u: None)
        u1, u2 = _u(a, 1), _u(a, 2)
        assert await a.open(u1) and await a.open(u2)
        # Redis restarted empty (only this test's keys: the server is shared)
        async for k in r.scan_iter(f"pdserve:{model}:*"):
            await r.delete(k)
        assert await a.close(u1.usage_id)  # gone without a tombstone: the owner bills it
        await a.refresh()  # its registration was gone: the requests still open are covered again
        assert await r.hkeys(f"pdserve:{model}:usage:open:{a.replica}") == [u2.usage_id.encode()]
        assert await a.close(u2.usage_id)
        assert await r.hlen(f"pdserve:{model}:usage:open:{a.replica}") == 0
    _run(body)
