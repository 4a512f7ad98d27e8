"""Tenant KV shares at stage-two admission (spec §1.2, §5.5, Q22; docs/admission.md "Tenant KV shares"): a
guaranteed share held back for an active tenant, borrowable while it is idle, and a cap. The same numbers on the
Redis ledger (the Lua script, real Redis) and on the local ledger that stands in while Redis is away; then the
Admission front: a quiet tenant is admitted at once within its share while a noisy one saturates and queues."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
import redis.asyncio as aioredis

from pdserve.services.admission import Admission, Capacity
from pdserve.services.gateway.tenants import TenantDirectory
from pdserve.services.kv_shares import KVShare
from pdserve.services.reservations import ReservationLedger

REDIS = "redis://127.0.0.1:6379/0"
CAP = Capacity(blocks=100, seqs=64, block_size=16, max_worker_blocks=100)


def _redis_up() -> bool:
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", 6379)) == 0


async def _ledger(kind: str, model: str):
    if kind == "redis":
        if not _redis_up():
            pytest.skip("needs Redis on 127.0.0.1:6379")
        return ReservationLedger(aioredis.from_url(REDIS), model, lease_s=30)
    return ReservationLedger(None, model, lease_s=30)  # the local ledger, same rule


async def _close(led: ReservationLedger) -> None:
    if led.redis is not None:
        keys = [k async for k in led.redis.scan_iter(led.zkey.rsplit(":", 1)[0] + ":*")]
        if keys:
            await led.redis.delete(*keys)
        await led.redis.aclose()


async def fill(led, prefix: str, blocks: int, share: KVShare, limit: int = 50) -> int:
    """Reserve `blocks`-block requests for `share` until refused: how many were admitted."""
    for i in range(limit):
        if not await led.reserve(f"{prefix}{i}", blocks, CAP, share):
            return i
    return limit


def test_tenants_file_kv_settings(tmp_path):
    p = tmp_path / "k.yaml"
    p.write_text("tenants:\n  quiet: {keys: [sk-q], kv_share: 0.2, kv_idle_s: 5}\n"
                 "  noisy: {keys: [sk-n], kv_max_share: 0.9}\n")
    d = TenantDirectory(str(p))
    assert d.authenticate("sk-q").kv == KVShare("quiet", 0.2, 1.0, 5.0)
    assert d.authenticate("sk-n").kv == KVShare("noisy", 0.0, 0.9, 30.0)
    for bad, what in [({"a": {"kv_share": 0.6}, "b": {"kv_share": 0.5}}, "add up to 1.1"),
                      ({"a": {"kv_share": 0.5, "kv_max_share": 0.4}}, "kv_share"),
                      ({"a": {"kv_share": "half"}}, "must be a number"),
                      ({"a": {"kv_max_share": 1.5}}, "<= 1")]:
        j = tmp_path / "bad.json"
        j.write_text(json.dumps({"tenants": bad}))
        with pytest.raises(ValueError, match=what):
            TenantDirectory(str(j))


@pytest.mark.parametrize("kind", ["redis", "local"])
def test_guarantee_held_for_an_active_tenant(kind):
    quiet, noisy = KVShare("quiet", 0.2, 1.0, 30.0), KVShare("noisy", 0.0, 1.0, 30.0)

    async def main():
        led = await _ledger(kind, f"t-{uuid.uuid4().hex[:8]}")
        try:
            assert await led.reserve("q-first", 1, CAP, quiet)  # quiet is active and holds 1 of its 20
            # noisy may hold C - reserved - quiet's unused guarantee: 100 - 1 - (20 - 1) = 80 -> 8 x 10 blocks
            assert await fill(led, "n", 10, noisy) == 8
            # quiet, within its share, still finds 19 blocks: 3 x 5 (the 4th would need 20)
            assert await fill(led, "q", 5, quiet) == 3
            assert await led.usage() == (96, 12)
            # quiet fills the rest of its share (1 + 15 + 4 = 20); noisy finds nothing
            assert await led.reserve("q-extra", 4, CAP, quiet)
            assert not await led.reserve("n-more", 1, CAP, noisy)
        finally:
            await _close(led)

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["redis", "local"])
def test_idle_guarantee_is_borrowed_then_given_back(kind):
    quiet, noisy = KVShare("quiet", 0.2, 1.0, 0.3), KVShare("noisy", 0.0, 1.0, 30.0)

    async def main():
        led = await _ledger(kind, f"t-{uuid.uuid4().hex[:8]}")
        try:
            assert await led.reserve("q0", 5, CAP, quiet)
            await led.release("q0")
            assert await fill(led, "a", 10, noisy) == 8  # quiet asked 0.3 s ago: its 20 still held back
            await asyncio.sleep(0.5)  # quiet idle for longer than its kv_idle_s: the guarantee is surplus
            assert await fill(led, "b", 10, noisy) == 2  # noisy borrows all 100
            # quiet comes back: nothing free now; asking makes it active, so noisy cannot re-take what frees
            assert not await led.reserve("q1", 5, CAP, quiet)
            await led.release("a0")  # 10 blocks free
            assert not await led.reserve("a0-again", 10, CAP, noisy)  # owed to quiet: 100 - 90 - 20 < 10
            assert await led.reserve("q1", 5, CAP, quiet)
            assert await led.reserve("q2", 5, CAP, quiet)
        finally:
            await _close(led)

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["redis", "local"])
def test_guarantee_holds_back_sequence_slots_too(kind):
    """10 slots, quiet g = 0.2 -> 2 slots held back: a noisy tenant of 1-block requests gets 8, quiet its 2."""
    cap = Capacity(blocks=100, seqs=10, block_size=16, max_worker_blocks=100)
    quiet, noisy = KVShare("quiet", 0.2, 1.0, 30.0), KVShare("noisy", 0.0, 1.0, 30.0)

    async def main():
        led = await _ledger(kind, f"t-{uuid.uuid4().hex[:8]}")
        try:
            assert not await led.reserve("q-big", 101, cap, quiet)  # refused, but quiet is active now
            admitted = 0
            for i in range(12):
                admitted += await led.reserve(f"n{i}", 1, cap, noisy)
            assert admitted == 8
            assert await led.reserve("q1", 1, cap, quiet) and await led.reserve("q2", 1, cap, quiet)
            assert not await led.reserve("q3", 1, cap, quiet)  # all 10 slots taken
        finally:
            await _close(led)

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["redis", "local"])
def test_cap_and_degrade_within_share(kind):
    capped = KVShare("capped", 0.0, 0.35, 30.0)

    async def main():
        led = await _ledger(kind, f"t-{uuid.uuid4().hex[:8]}")
        try:
            assert await fill(led, "c", 10, capped) == 3  # floor(0.35 x 100) = 35 -> 3 x 10
            assert await led.reserve("c-small", 5, CAP, capped)
            assert not await led.reserve("c-one", 1, CAP, capped)
            assert await led.reserve("other", 60, CAP, KVShare("other"))  # everyone else: the old rule
        finally:
            await _close(led)

    asyncio.run(main())


def test_quiet_admitted_at_once_while_noisy_saturates():
    if not _redis_up():
        pytest.skip("needs Redis on 127.0.0.1:6379")
    model = f"t-{uuid.uuid4().hex[:8]}"
    quiet, noisy = KVShare("quiet", 0.2, 1.0, 30.0), KVShare("noisy", 0.0, 1.0, 30.0)

    async def cap():
        return CAP

    async def main():
        r = aioredis.from_url(REDIS)
        adm = Admission(ReservationLedger(r, model, lease_s=30), cap, max_queue=16, max_queue_wait_s=20)
        far = time.time() + 60
        try:
            await adm.admit("q-hello", "quiet", 16, 16, 1, 4096, far, share=quiet)  # 1 + 1 blocks: active
            await adm.release("q-hello")
            # noisy: 144-token prompts + 16 output = 10 blocks; 8 fit (100 - 20 held for quiet), 4 more queue
            admitted = [await adm.admit(f"n{i}", "noisy", 144, 16, 1, 4096, far, share=noisy) for i in range(8)]
            assert all(not t.states for t in admitted)
            waiting = [asyncio.create_task(adm.admit(f"w{i}", "noisy", 144, 16, 1, 4096, far, share=noisy))
                       for i in range(4)]
            await asyncio.sleep(0.2)
            assert adm.queued == 4
            # quiet: 64-token prompts + 16 output = 5 blocks; all 4 (20 blocks) admitted at once, none queued
            t0 = time.monotonic()
            qs = [await adm.admit(f"q{i}", "quiet", 64, 16, 1, 4096, far, share=quiet) for i in range(4)]
            assert all(not t.states for t in qs) and time.monotonic() - t0 < 1.0
            assert await adm.ledger.usage() == (100, 12)
            # the noisy waiters get in only as noisy's own reservations end
            for i in range(4):
                await adm.release(f"n{i}")
            done = await asyncio.gather(*waiting)
            assert all(t.states == ["QUEUED"] for t in done)
        finally:
            for rid in list(adm.held):
                await adm.release(rid)
            keys = [k async for k in r.scan_iter(f"pdserve:{model}:*")]
            if keys:
                await r.delete(*keys)
            await r.aclose()

    asyncio.run(main())
