"""Admission net of prefix-cache hits (spec §1.2 stage two, §0.1): a request placed where its prompt's prefix is
cached reserves only what that worker does not hold; the hit's blocks are pinned and counted once however many
requests hold them, on real Redis and on the local ledger alike. The figures are block arithmetic written out
by hand (16-token blocks), not the code's output."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from pdserve.services.admission import Admission, AdmissionError, Capacity
from pdserve.services.prefix_pins import PrefixHit
from pdserve.services.reservations import ReservationLedger

REDIS = "redis://127.0.0.1:6379/0"
BS = 16
PREFIX = list(range(1000, 1160))  # 160 tokens: 10 full blocks, the shared system prompt
N = 4


def _redis_up() -> bool:
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", 6379)) == 0


def _prompt(i: int, prefix: list[int] = PREFIX) -> list[int]:
    return prefix + [7, 7, 7, 7, 7, 7, 7, i]  # 168 tokens: ceil(168/16) = 11 blocks


# one uncached copy: 11 prompt blocks + 1 output block (max_tokens 16) = 12; each other request's suffix and
# output with the prefix cached: 11 - 10 + 1 = 2 blocks. The budget: 12 + (N - 1) x 2 = 18 blocks
BUDGET = 12 + (N - 1) * 2
CAP = Capacity(blocks=BUDGET, seqs=64, block_size=BS, max_worker_blocks=BUDGET)


async def _cap():
    return CAP


def _ledgers():
    yield "local", None
    if _redis_up():
        yield "redis", REDIS


async def _make(url, model, lease_s=5.0):
    r = aioredis.from_url(url) if url else None
    adm = Admission(ReservationLedger(r, model, lease_s=lease_s), _cap, max_queue=0, max_queue_wait_s=0.2)
    return r, adm


async def _cleanup(r, model):
    if r is None:
        return
    keys = [k async for k in r.scan_iter(f"pdserve:{model}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


def _hit(i: int, worker: str = "both-1", prefix: list[int] = PREFIX, cached: int = 160) -> PrefixHit:
    return PrefixHit(worker, "tenant:t", tuple(_prompt(i, prefix)), cached)


@pytest.mark.parametrize("name,url", list(_ledgers()))
def test_shared_prefix_admitted_together_distinct_prefixes_not(name, url):
    model = f"t-{uuid.uuid4().hex[:8]}"

    async def main():
        r, adm = await _make(url, model)
        far = time.time() + 30
        try:
            # N requests behind one cached prefix on the worker they are placed on: all admitted at once
            tickets = [await adm.admit(f"s{i}", "t", 168, 16, 1, 4096, far, hit=_hit(i)) for i in range(N)]
            assert all(t.states == [] for t in tickets)  # none queued, none degraded
            assert await adm.ledger.usage() == (BUDGET, N)  # the 10 pinned blocks once, 2 of each request's own
            for i in range(N):
                await adm.release(f"s{i}")
            assert await adm.ledger.usage() == (0, 0)
            # the same N with distinct prefixes (no hit anywhere): one fits, the rest are refused (queue of 0)
            admitted, refused = 0, 0
            for i in range(N):
                other = [5000 + 200 * i + j for j in range(160)]
                try:
                    await adm.admit(f"d{i}", "t", len(_prompt(i, other)), 16, 1, 4096, far)
                    admitted += 1
                except AdmissionError as e:
                    assert e.status == 503 and e.code == "capacity"
                    refused += 1
            assert (admitted, refused) == (1, N - 1)
            assert await adm.ledger.usage() == (12, 1)
            await adm.release("d0")
        finally:
            await _cleanup(r, model)

    asyncio.run(main())


@pytest.mark.parametrize("name,url", list(_ledgers()))
def test_pins_count_once_until_the_last_holder_and_a_lost_hit_is_reserved(name, url):
    model = f"t-{uuid.uuid4().hex[:8]}"

    async def main():
        r, adm = await _make(url, model)
        adm.capacity_fn = _big
        far = time.time() + 30
        try:
            await adm.admit("a", "t", 168, 16, 1, 4096, far, hit=_hit(0))
            await adm.admit("b", "t", 168, 16, 1, 4096, far, hit=_hit(1))
            assert await adm.ledger.usage() == (10 + 2 + 2, 2)
            # a shorter hit on the same prefix (its first 5 blocks) pins nothing new: 11 - 5 + 1 = 7 of its own
            await adm.admit("c", "t", 168, 16, 1, 4096, far, hit=_hit(2, cached=80))
            assert await adm.ledger.usage() == (10 + 2 + 2 + 7, 3)
            # the same prefix on another worker is another copy of it: 10 more pins
            await adm.admit("e", "t", 168, 16, 1, 4096, far, hit=_hit(3, worker="both-2"))
            assert await adm.ledger.usage() == (10 + 2 + 2 + 7 + 10 + 2, 4)
            await adm.release("e")
            # a holder leaves: the pins stay while others hold them
            await adm.release("a")
            assert await adm.ledger.usage() == (10 + 2 + 7, 2)
            # b's hit is lost (placed elsewhere before its prefill): it now needs its whole prompt (11 + 1)
            await adm.lose_hit("b")
            await adm.lose_hit("b")  # idempotent
            # its 10 pins go; c still holds the first 5 of them
            assert await adm.ledger.usage() == (5 + 12 + 7, 2)
            await adm.release("b")
            await adm.release("c")
            assert await adm.ledger.usage() == (0, 0)
        finally:
            await _cleanup(r, model)

    asyncio.run(main())


async def _big():
    return Capacity(blocks=1000, seqs=64, block_size=BS, max_worker_blocks=1000)


@pytest.mark.skipif(not _redis_up(), reason="needs Redis on 127.0.0.1:6379")
def test_pins_lapse_with_their_lease_and_come_back_with_the_renewal():
    """A gateway that dies stops renewing: its requests' pins go with their leases. After a Redis wipe the renew
    loop writes reservations and their pins back."""
    model = f"t-{uuid.uuid4().hex[:8]}"

    async def main():
        r, adm = await _make(REDIS, model, lease_s=0.5)
        adm.capacity_fn = _big
        far = time.time() + 30
        ledger = adm.ledger
        try:
            await adm.admit("a", "t", 168, 16, 1, 4096, far, hit=_hit(0))
            await adm.admit("b", "t", 168, 16, 1, 4096, far, hit=_hit(1))
            await r.delete(*[k async for k in r.scan_iter(f"pdserve:{model}:*")])  # Redis restarted empty
            await adm.renew_once()
            assert await ledger.usage() == (10 + 2 + 2, 2)
            assert await r.hlen(ledger.pkey) == 10
            await asyncio.sleep(0.7)  # not renewed: both leases lapse, and every pin with them
            assert await ledger.usage() == (0, 0)
            assert await r.hlen(ledger.pkey) == 0 and await r.hlen(ledger.rpkey) == 0
        finally:
            await _cleanup(r, model)

    asyncio.run(main())


def test_pin_keys_follow_worker_namespace_and_every_token_before():
    a = PrefixHit("w1", "ns", tuple(range(40)), 40).pins(BS)
    assert len(a) == 2  # full blocks only: 40 tokens = 2 blocks + 8
    assert PrefixHit("w1", "ns", tuple(range(40)), 20).pins(BS) == a[:1]
    assert PrefixHit("w2", "ns", tuple(range(40)), 40).pins(BS)[0] != a[0]
    assert PrefixHit("w1", "other", tuple(range(40)), 40).pins(BS)[0] != a[0]
    changed = (99,) + tuple(range(1, 40))
    assert PrefixHit("w1", "ns", changed, 40).pins(BS)[1] != a[1]  # a key depends on every token before it


@pytest.mark.skipif(not _redis_up(), reason="needs Redis on 127.0.0.1:6379")
def test_a_hit_lost_during_a_renew_does_not_come_back():
    """The renew script re-adds the pins it is handed (its recovery after a Redis restart): pins given up while a
    renew call is in flight must not stay counted beside the blocks that replaced them."""
    model = f"t-{uuid.uuid4().hex[:8]}"

    async def main():
        r, adm = await _make(REDIS, model)
        adm.capacity_fn = _big
        ledger = adm.ledger
        try:
            await adm.admit("a", "t", 168, 16, 1, 4096, time.time() + 30, hit=_hit(0))
            real_renew = ledger.renew

            async def renew_racing_a_lost_hit(*args):
                await adm.lose_hit("a")  # placed elsewhere between the snapshot and the script
                await real_renew(*args)

            ledger.renew = renew_racing_a_lost_hit
            await adm.renew_once()
            assert await ledger.usage() == (12, 1)  # its whole prompt as its own, no pin beside it
            assert await r.hlen(ledger.pkey) == 0
        finally:
            await _cleanup(r, model)

    asyncio.run(main())


def _route(mode: str, cached: int = 0, decode_cached: int = 0):
    from pdserve.services.pb import router_pb2
    r = router_pb2.RouteResponse(mode=mode, cached_tokens=cached, decode_cached_tokens=decode_cached)
    if mode == "colocated":
        r.both.worker_id = "both-1"
    else:
        r.prefill.worker_id, r.decode.worker_id = "prefill-1", "decode-1"
    return r


def test_disaggregated_hit_is_the_decode_workers():
    """Disaggregated, the blocks reserved are the decode worker's, which pulls only what its prefix cache lacks:
    its hit is pinned (the prefill worker's hit, `cached_tokens`, reserves nothing there)."""
    from pdserve.services.prefix_pins import hit_of, kv_holder
    p = _prompt(0)
    assert hit_of(_route("disagg", cached=160, decode_cached=0), "tenant:t", p) is None
    h = hit_of(_route("disagg", cached=0, decode_cached=160), "tenant:t", p)
    assert (h.worker_id, h.cached_tokens, len(h.pins(BS))) == ("decode-1", 160, 10)
    assert kv_holder(_route("disagg")) == "decode-1" and kv_holder(_route("colocated")) == "both-1"
    # a colocated request on the same worker behind the same prefix shares the pins
    assert h.pins(BS) == _hit(0, worker="decode-1").pins(BS)
    assert hit_of(_route("colocated", cached=160, decode_cached=999), "tenant:t", p).cached_tokens == 160


@pytest.mark.parametrize("name,url", list(_ledgers()))
def test_disaggregated_next_turns_admitted_together(name, url):
    """N next turns of chats placed on the decode worker that holds their shared prefix fit the budget of one
    uncached copy plus N - 1 suffixes (the whole prompt reserved for each: 1 of N)."""
    from pdserve.services.prefix_pins import hit_of
    model = f"t-{uuid.uuid4().hex[:8]}"

    async def main():
        r, adm = await _make(url, model)
        far = time.time() + 30
        try:
            for i in range(N):
                hit = hit_of(_route("disagg", decode_cached=160), "tenant:t", _prompt(i))
                t = await adm.admit(f"d{i}", "t", 168, 16, 1, 4096, far, hit=hit)
                assert t.states == []
            assert await adm.ledger.usage() == (BUDGET, N)
        finally:
            await _cleanup(r, model)

    asyncio.run(main())
