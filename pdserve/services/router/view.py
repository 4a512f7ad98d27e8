"""The live view of the workers: registry records + their load reports (+ the prefix index in the router).

Routing and admission must judge the same workers by the same numbers, so both read this (docs/routing.md):

    view = LiveView(Registry(redis_url, model))      # any process with Redis access (gateway, router)
    await view.refresh()                             # or: asyncio.create_task(view.run_forever())
    for wid, w in view.costs().items():              # WorkerCost: measured rates with priors filled in
        w.kv_free_blocks, w.kv_usage, w.queue_s, w.rate, w.step, w.rec.role, w.rec.load.<field>

Without Redis access, the router's ListWorkers RPC returns the same records and load reports.
In the router the view also keeps the prefix index in step with the live workers (dead ones are dropped) and
applies the KV event stream; all of that runs in ONE task so a snapshot and the events after it never
interleave (prefix_index.py explains why that matters).
"""
from __future__ import annotations

import asyncio
import logging
import time

from pdserve.services.metrics import router as M
from pdserve.services.registry import Registry, WorkerRecord
from pdserve.services.router.cost import Priors, WorkerCost, peer_priors
from pdserve.services.router.prefix_index import IndexSync

log = logging.getLogger("pdserve.router.view")


class LiveView:
    def __init__(self, registry: Registry, index_sync: IndexSync | None = None, refresh_s: float = 0.2,
                 priors: Priors | None = None):
        self.registry = registry
        self.sync = index_sync
        self.refresh_s = refresh_s
        self.priors = priors or Priors()
        self._records: list[WorkerRecord] = []
        self.refreshed_at = 0.0

    def records(self) -> list[WorkerRecord]:
        return list(self._records)

    def costs(self) -> dict[str, WorkerCost]:
        return {r.worker_id: WorkerCost.of(r, peer_priors(self.priors, r, self._records)) for r in self._records}

    def get(self, worker_id: str) -> WorkerCost | None:
        for r in self._records:
            if r.worker_id == worker_id:
                return WorkerCost.of(r, peer_priors(self.priors, r, self._records))
        return None

    async def refresh(self) -> list[WorkerRecord]:
        self._records = await self.registry.live_workers()
        self.refreshed_at = time.monotonic()
        if self.sync is not None:
            await self.sync.sync_workers(r.worker_id for r in self._records)
            M.PREFIX_INDEX_BLOCKS.set(len(self.sync.index))
        return self._records

    async def step(self, poll_ms: int = 50) -> None:
        """One iteration: apply pending KV events, refresh the registry view when due."""
        if self.sync is not None:
            n = await self.sync.poll(block_ms=poll_ms)
            if n:
                M.PREFIX_INDEX_EVENTS.inc(n)
                M.PREFIX_INDEX_BLOCKS.set(len(self.sync.index))
        else:
            await asyncio.sleep(poll_ms / 1000)
        if time.monotonic() - self.refreshed_at >= self.refresh_s:
            await self.refresh()

    async def run_forever(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis blip: keep the last view, retry
                log.warning("live view refresh failed: %s", e)
                await asyncio.sleep(0.5)
