"""How the replicas' KV block events reach the router's prefix index in the simulator.

A real worker drains its BlockManager's stored/evicted events and publishes them every 0.1 s
(`publish_forever`); the router applies them to its `PrefixIndex`. Both feeds here deliver each step's events
`delay_s` of virtual time after the step that produced them:

- `DirectIndex`: into an in-process `PrefixIndex` (no Redis; what the cluster-scale simulations use);
- `RedisIndex`: through the real path - each replica's `KvEventPublisher` writes its set and the event stream in
  Redis, the router's `IndexSync` follows the stream - so a restarted router can rebuild its index from Redis.
  It owns its Redis client and a private event loop (the simulation itself is synchronous), and must be closed.
"""
from __future__ import annotations

import asyncio
import uuid
from collections import deque

from pdserve.services.kv_events import KvEventPublisher
from pdserve.services.router.prefix_index import IndexSync, PrefixIndex


class DirectIndex:
    def __init__(self, delay_s: float = 0.1):
        self.index = PrefixIndex()
        self.delay_s = delay_s
        self._outbox: deque = deque()  # (due time, worker, events), in time order

    def publish(self, worker: str, events: list, now: float) -> None:
        if events:
            self._outbox.append((now + self.delay_s, worker, events))

    def _due(self, now: float) -> list:
        out = []
        while self._outbox and self._outbox[0][0] <= now:
            out.append(self._outbox.popleft())
        return out

    def sync(self, now: float) -> None:
        """Apply every event due by `now` (called before each routing decision)."""
        for _, worker, events in self._due(now):
            for e in events:
                if e.kind == "stored":
                    self.index.add(worker, (e.namespace, e.block_hash))
                else:
                    self.index.remove(worker, (e.namespace, e.block_hash))

    def close(self) -> None:
        pass


class RedisIndex(DirectIndex):
    def __init__(self, redis_url: str, workers: list[str], delay_s: float = 0.1, model: str | None = None):
        import redis.asyncio as aioredis

        super().__init__(delay_s)
        self.model = model or f"sim-{uuid.uuid4().hex[:8]}"
        self.workers = list(workers)
        self._loop = asyncio.new_event_loop()
        self._redis = aioredis.from_url(redis_url)
        self._pubs = {w: KvEventPublisher(self._redis, self.model, w) for w in self.workers}
        self._index_sync: IndexSync | None = None
        self._loop.run_until_complete(self._start())

    async def _start(self) -> None:
        for p in self._pubs.values():  # a started worker's cache is empty
            await p.reset()
        await self._attach()

    async def _attach(self) -> None:
        self._index_sync = IndexSync(self._redis, self.model)
        await self._index_sync.sync_workers(self.workers)
        await self._index_sync.poll(block_ms=None, count=1_000_000)
        self.index = self._index_sync.index

    def sync(self, now: float) -> None:
        due = self._due(now)
        if due:
            self._loop.run_until_complete(self._deliver(due))

    async def _deliver(self, due: list) -> None:
        for _, worker, events in due:
            await self._pubs[worker].publish(events)
        await self._index_sync.poll(block_ms=None, count=1_000_000)

    def restart_router(self) -> PrefixIndex:
        """A new router process: a fresh `IndexSync` rebuilt from Redis (snapshots, then the stream)."""
        self._loop.run_until_complete(self._attach())
        return self.index

    def close(self) -> None:
        """Delete this simulation's keys and close the client (idempotent)."""
        if self._loop.is_closed():
            return
        self._loop.run_until_complete(self._cleanup())
        self._loop.close()

    async def _cleanup(self) -> None:
        try:
            async for k in self._redis.scan_iter(f"pdserve:{self.model}:*"):
                await self._redis.delete(k)
        finally:
            await self._redis.aclose()
