"""Redis worker registry.

Key `pdserve:{model}:workers:{id}` is a hash (role, address, agent_name, capacity_blocks, layout, load,
updated) whose TTL is refreshed by every heartbeat: a worker that stops heartbeating disappears by itself, so a
lapsed worker can never be routed to. `pdserve:{model}:worker_ids` is a set indexing the hashes (stale members
are pruned on read). KV events (the prefix index) live in router/prefix_index.py's keys.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis

DEFAULT_TTL_S = 3.0


def workers_key(model: str, worker_id: str) -> str:
    return f"pdserve:{model}:workers:{worker_id}"


def index_key(model: str) -> str:
    return f"pdserve:{model}:worker_ids"


@dataclass
class WorkerRecord:
    worker_id: str
    role: str  # prefill | decode | both
    address: str
    agent_name: str = ""
    capacity_blocks: int = 0
    layout: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)
    updated: float = 0.0

    def to_hash(self) -> dict[str, str]:
        d = asdict(self)
        d["layout"] = json.dumps(self.layout)
        d["load"] = json.dumps(self.load)
        return {k: str(v) for k, v in d.items()}

    @classmethod
    def from_hash(cls, h: dict) -> "WorkerRecord":
        h = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in h.items()}
        return cls(worker_id=h["worker_id"], role=h["role"], address=h["address"],
                   agent_name=h.get("agent_name", ""), capacity_blocks=int(h.get("capacity_blocks", 0) or 0),
                   layout=json.loads(h.get("layout") or "{}"), load=json.loads(h.get("load") or "{}"),
                   updated=float(h.get("updated", 0) or 0))


class Registry:
    def __init__(self, redis_url: str, model: str, ttl_s: float = DEFAULT_TTL_S):
        self.model = model
        self.ttl_s = ttl_s
        self.r = aioredis.from_url(redis_url)

    async def heartbeat(self, rec: WorkerRecord) -> None:
        """Register or refresh (same write: a worker that lapsed re-registers with its next heartbeat)."""
        rec.updated = time.time()
        key = workers_key(self.model, rec.worker_id)
        async with self.r.pipeline(transaction=True) as p:
            p.hset(key, mapping=rec.to_hash())
            p.pexpire(key, int(self.ttl_s * 1000))
            p.sadd(index_key(self.model), rec.worker_id)
            await p.execute()

    async def deregister(self, worker_id: str) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.delete(workers_key(self.model, worker_id))
            p.srem(index_key(self.model), worker_id)
            await p.execute()

    async def live_workers(self) -> list[WorkerRecord]:
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
            rec = WorkerRecord.from_hash(h)
            if now - rec.updated > self.ttl_s:  # belt and braces if a TTL refresh raced
                continue
            out.append(rec)
        if stale:
            await self.r.srem(index_key(self.model), *stale)
        return out

    async def close(self) -> None:
        await self.r.aclose()
