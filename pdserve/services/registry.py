"""Redis worker registry.

Key `pdserve:{model}:workers:{id}` is a hash (`info`: a serialized WorkerInfo, `load`: a serialized LoadReport,
`updated`: unix time) whose TTL is refreshed by every heartbeat: a worker that stops heartbeating disappears by itself, so a
lapsed worker can never be routed to. `pdserve:{model}:worker_ids` is a set indexing the hashes (stale members
are pruned on read). KV events (the prefix index) live in router/prefix_index.py's keys.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from pdserve.services.pb import common_pb2

DEFAULT_TTL_S = 3.0


def workers_key(model: str, worker_id: str) -> str:
    return f"pdserve:{model}:workers:{worker_id}"


def index_key(model: str) -> str:
    return f"pdserve:{model}:worker_ids"


@dataclass
class WorkerRecord:
    """A live worker as the registry holds it; `load` is its last LoadReport (services/convert.py converts)."""

    worker_id: str
    role: str  # prefill | decode | both
    address: str
    agent_name: str = ""
    capacity_blocks: int = 0
    layout: common_pb2.KvLayout = field(default_factory=common_pb2.KvLayout)
    load: common_pb2.LoadReport = field(default_factory=common_pb2.LoadReport)
    updated: float = 0.0


class Registry:
    def __init__(self, redis_url: str, model: str, ttl_s: float = DEFAULT_TTL_S):
        self.model = model
        self.ttl_s = ttl_s
        self.r = aioredis.from_url(redis_url)

    async def heartbeat(self, rec: WorkerRecord) -> None:
        """Register or refresh (same write: a worker that lapsed re-registers with its next heartbeat)."""
        from pdserve.services import convert  # convert imports WorkerRecord from here
        rec.updated = time.time()
        key = workers_key(self.model, rec.worker_id)
        async with self.r.pipeline(transaction=True) as p:
            p.hset(key, mapping=convert.record_to_hash(rec))
            p.pexpire(key, int(self.ttl_s * 1000))
            p.sadd(index_key(self.model), rec.worker_id)
            await p.execute()

    async def deregister(self, worker_id: str) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.delete(workers_key(self.model, worker_id))
            p.srem(index_key(self.model), worker_id)
            await p.execute()

    async def live_workers(self) -> list[WorkerRecord]:
        from pdserve.services import convert
        ids = sorted(m.decode() for m in await self.r.smembers(index_key(self.model)))
        if not ids:
            return []
        async with self.r.pipeline(transaction=False) as p:
            for i in ids:
                p.hgetall(workers_key(self.model, i))
            hashes = await p.execute()
        out, stale = [], []
        now = time.time()
        for i, h in zip(ids, hashes):
            if not h:
                stale.append(i)  # hash expired: heartbeat lapsed
                continue
            rec = convert.record_from_hash(h)
            if now - rec.updated > self.ttl_s:  # belt and braces if a TTL refresh raced
                continue
            out.append(rec)
        if stale:
            await self.r.srem(index_key(self.model), *stale)
        return out

    async def close(self) -> None:
        await self.r.aclose()

