"""Admission against a real Redis: the output predictor, reservation leases (expiry frees, replicas share,
recovery after a Redis wipe, a release racing a renew), queue / degrade / reject, the largest feasible n, one
registry read at a time. Deadline-aware admission: test_admission_deadlines.py; the ingress gate:
gateway/test_ingress.py."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from pdserve.services.admission import Admission, AdmissionError, Capacity, OutputPredictor, blocks_for
from pdserve.services.gateway.params import APIError
from pdserve.services.reservations import ReservationLedger
from tests.services._redis import REDIS, cleanup, redis_up, run

pytestmark = pytest.mark.skipif(not redis_up(), reason="needs Redis on 127.0.0.1:6379")


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
        await cleanup(r1, model)

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
        assert (t2.n_granted, t2.blocks, t2.degraded) == (2, 5, False)
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
        await cleanup(r, model)

    run(main())


# ---- n: the largest feasible n computed in one script call; never-fitting requests answered 400 at once -------
def test_largest_copies_computed_not_searched():
    from pdserve.services.admission import plan_for
    from pdserve.services.reservations import Plan, largest_copies
    p = plan_for(33, 20, 128, 16)  # 3 prompt blocks + 2 per copy
    assert p == Plan(3, 2, 128, 1)
    assert largest_copies(3 + 2 * 7 + 1, p) == 7  # 18 free: 7 copies (17 blocks), not 8
    assert largest_copies(2, p) == 0  # not even the prompt
    assert largest_copies(10 ** 9, p) == 128  # capped at n
    strict = plan_for(33, 20, 8, 16, allow_degrade=False)
    assert largest_copies(3 + 2 * 7, strict) == 0 and largest_copies(3 + 2 * 8, strict) == 8


def test_degrade_is_one_script_call_and_never_fitting_is_400_at_once():
    model = f"t-{uuid.uuid4().hex[:8]}"
    cap = Capacity(blocks=1000, seqs=8, block_size=16, max_worker_blocks=500)

    async def capacity():
        return cap

    async def main():
        r = aioredis.from_url(REDIS)
        adm = Admission(ReservationLedger(r, model, lease_s=5), capacity, max_queue=4, max_queue_wait_s=5)
        calls = 0
        script = adm.ledger._reserve

        async def counting(*a, **kw):
            nonlocal calls
            calls += 1
            return await script(*a, **kw)

        adm.ledger._reserve = counting
        far = time.time() + 30
        # n=128 x 16 output tokens = 128 blocks + 1 prompt block: fits 1000 -> granted whole, one call
        t = await adm.admit("a", "t", 10, 16, 128, 4096, far)
        assert (t.n_granted, t.blocks, calls) == (128, 129, 1)
        # 871 blocks left; n=128 x 10 blocks (160 tokens) = 1281 does not fit -> degraded to the largest k that
        # does: (871 - 1) // 10 = 87, in ONE script call (the old loop tried k = 128, 127, ... one call each)
        calls = 0
        t = await adm.admit("b", "t", 10, 160, 128, 4096, far)
        assert (t.n_granted, t.blocks, t.states, calls) == (87, 871, ["DEGRADED"], 1)
        assert await adm.ledger.usage() == (1000, 2)
        # never fits even an empty pool (n=128 x 16 blocks + 1 > 1000) with allow_degrade false: 400 naming n,
        # at once, without touching the ledger
        calls = 0
        t0 = time.monotonic()
        with pytest.raises(AdmissionError) as e:
            await adm.admit("c", "t", 10, 250, 128, 4096, far, allow_degrade=False)
        assert e.value.status == 400 and e.value.param == "n" and e.value.code == "kv_capacity_exceeded"
        assert time.monotonic() - t0 < 0.1 and calls == 0
        # the same request allowed to degrade is not refused: it waits for capacity (queue) like any other
        waiter = asyncio.create_task(adm.admit("d", "t", 10, 250, 128, 4096, far))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await adm.release("a")
        await adm.release("b")
        t = await waiter
        assert t.n_granted == (1000 - 1) // 16 and t.states == ["QUEUED", "DEGRADED"]
        await adm.release("d")
        assert await adm.ledger.usage() == (0, 0)
        await cleanup(r, model)

    run(main())


def test_n_capped_at_128_with_a_400_naming_n():
    from pdserve.services.gateway.params import to_sampling_params
    assert to_sampling_params({"prompt": "x", "n": 128}, chat=False, vocab_size=100).n == 128
    for n in (129, 1000000):
        with pytest.raises(APIError) as e:
            to_sampling_params({"prompt": "x", "max_tokens": 1, "n": n}, chat=False, vocab_size=100)
        assert e.value.status == 400 and e.value.param == "n" and "128" in e.value.message


def test_release_during_a_renew_does_not_resurrect_the_reservation():
    """The renew script re-adds every reservation it is handed (so the ledger recovers after a Redis restart). A
    release that lands while a renew call is in flight must not come back with it — in the abort storm this left
    reservations behind until their lease lapsed."""
    model = f"t-{uuid.uuid4().hex[:8]}"

    async def main():
        r = aioredis.from_url(REDIS)
        ledger = ReservationLedger(r, model, lease_s=5)
        adm = Admission(ledger, _cap, max_queue=1, max_queue_wait_s=0.3)
        await adm.admit("a", "t", 10, 20, 1, 4096, time.time() + 30)
        real_renew = ledger.renew

        async def renew_racing_a_release(held, *tenants):
            await adm.release("a")  # the request ends between the snapshot and the script
            await real_renew(held, *tenants)

        ledger.renew = renew_racing_a_release
        try:
            await adm.renew_once()
            assert await r.zcard(ledger.zkey) == 0 and await r.hlen(ledger.hkey) == 0
        finally:
            await cleanup(r, model)

    run(main())


def test_registry_capacity_one_read_at_a_time_and_stale_answers_at_once():
    """A burst that finds the cache stale makes one registry read, not one per request; while it runs the others
    get the last capacity without waiting. Before any is known, everyone waits for that one read."""
    from pdserve.services.admission import RegistryCapacity
    from pdserve.services.pb import common_pb2
    from pdserve.services.registry import Registry, WorkerRecord

    class HeldRegistry(Registry):  # the real registry on real Redis; each read waits until the test lets it go
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.reads, self.gate = 0, asyncio.Event()

        async def live_workers(self):
            self.reads += 1
            await self.gate.wait()
            return await super().live_workers()

    def worker(blocks: int) -> WorkerRecord:
        return WorkerRecord("w1", "both", "127.0.0.1:1", capacity_blocks=blocks,
                            layout=common_pb2.KvLayout(block_size=16),
                            load=common_pb2.LoadReport(kv_blocks_total=blocks))

    async def main():
        reg = HeldRegistry(REDIS, f"t-{uuid.uuid4().hex[:8]}", ttl_s=30)
        try:
            await reg.heartbeat(worker(100))
            cap = RegistryCapacity(reg, ttl_s=0.05)
            cold = [asyncio.ensure_future(cap()) for _ in range(20)]
            await asyncio.sleep(0.05)
            assert reg.reads == 1 and not any(t.done() for t in cold)  # nothing known yet: all wait for one read
            reg.gate.set()
            assert {c.blocks for c in await asyncio.gather(*cold)} == {100}
            reg.gate.clear()
            await reg.heartbeat(worker(60))
            await asyncio.sleep(0.1)  # stale now
            first = asyncio.ensure_future(cap())  # this one reads (and waits for it)
            await asyncio.sleep(0.01)
            stale = await asyncio.wait_for(asyncio.gather(*[cap() for _ in range(20)]), 0.5)
            assert {c.blocks for c in stale} == {100} and reg.reads == 2  # at once, from the cache, no new read
            reg.gate.set()
            assert (await first).blocks == 60
            assert (await cap()).blocks == 60 and reg.reads == 2  # fresh: no read
        finally:
            await reg.r.delete(*[k async for k in reg.r.scan_iter(f"pdserve:{reg.model}:*")] or ["-"])
            await reg.close()

    asyncio.run(main())
