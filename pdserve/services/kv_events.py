"""Worker side of the prefix index (router/prefix_index.py reads it): the engine's KV events, published to Redis.

The Redis keys are the contract between the two: `pdserve:{model}:kvblocks:{worker_id}` (set of
`"{hash:x}:{namespace}"`, or `"{hash:x}@{tier}:{namespace}"` for a block in the worker's host or disk KV tier,
engine/kv_offload.py) and the `pdserve:{model}:kv_events` stream (prefix_index.py's docstring explains why).
A block is in one tier at a time: a `stored` event names the tier that holds it now (the set member of any other
tier is removed in the same transaction); `evicted` means it left every tier.
"""
from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from pdserve.services.metrics import worker as M

log = logging.getLogger("pdserve.kv_events")

STREAM_MAXLEN = 200_000


def blocks_key(model: str, worker_id: str) -> str:
    return f"pdserve:{model}:kvblocks:{worker_id}"


def stream_key(model: str) -> str:
    return f"pdserve:{model}:kv_events"


TIERS = ("device", "host", "disk")


def _member(h: int, ns: str, tier: str = "device") -> str:
    return f"{h:x}:{ns}" if tier == "device" else f"{h:x}@{tier}:{ns}"


def parse_member_tier(m: str | bytes) -> tuple[str, int, str]:
    """(namespace, chained block hash, tier) of a set member."""
    if isinstance(m, bytes):
        m = m.decode()
    h, _, ns = m.partition(":")
    h, _, tier = h.partition("@")
    return ns, int(h, 16), tier or "device"


class KvEventPublisher:
    """Worker side: push the engine's drained KV events to Redis (set + stream, one transaction)."""

    def __init__(self, r: aioredis.Redis, model: str, worker_id: str, ttl_s: float = 60.0):
        self.r = r
        self.model = model
        self.worker_id = worker_id
        self.ttl_ms = int(ttl_s * 1000)
        self.published = 0

    async def reset(self) -> None:
        """A (re)started worker's cache is empty: whatever Redis remembers about it is stale."""
        async with self.r.pipeline(transaction=True) as p:
            p.delete(blocks_key(self.model, self.worker_id))
            p.xadd(stream_key(self.model), {"w": self.worker_id, "r": "1"}, maxlen=STREAM_MAXLEN,
                   approximate=True)
            await p.execute()

    async def publish(self, events: list) -> None:
        """events: engine KVEvent(kind, block_hash, namespace, tier), in the order the engine produced them."""
        key = blocks_key(self.model, self.worker_id)
        async with self.r.pipeline(transaction=True) as p:
            lines = []
            for ev in events:
                tier = getattr(ev, "tier", "device")
                others = [_member(ev.block_hash, ev.namespace, t) for t in TIERS if t != tier or ev.kind != "stored"]
                if others:
                    p.srem(key, *others)
                if ev.kind == "stored":
                    m = _member(ev.block_hash, ev.namespace, tier)
                    p.sadd(key, m)
                    lines.append("+" + m)
                else:
                    lines.append("-" + _member(ev.block_hash, ev.namespace))
            if lines:
                p.xadd(stream_key(self.model), {"w": self.worker_id, "e": "\n".join(lines)},
                       maxlen=STREAM_MAXLEN, approximate=True)
            p.pexpire(key, self.ttl_ms)  # also the keep-alive of an idle worker's set
            await p.execute()
        self.published += len(events)
        stored = sum(1 for ev in events if ev.kind == "stored")
        if stored:
            M.KV_EVENTS_PUBLISHED.labels("stored").inc(stored)
        if len(events) - stored:
            M.KV_EVENTS_PUBLISHED.labels("evicted").inc(len(events) - stored)


async def publish_forever(engine_host, pub: KvEventPublisher, interval_s: float = 0.1) -> None:
    """Drain the engine's KV events between steps and publish them (worker background task)."""
    await pub.reset()
    last_keepalive = 0.0
    while True:
        try:
            events = await engine_host.run(lambda e: e.drain_kv_events())
            if events or time.monotonic() - last_keepalive > 1.0:
                await pub.publish(events)
                last_keepalive = time.monotonic()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # Redis blip: the events are lost, the next reset/rebuild recovers
            log.warning("publishing KV events failed: %s", e)
        await asyncio.sleep(interval_s)
