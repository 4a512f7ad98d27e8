"""Prefill-side leases on pinned KV blocks.

A prefill worker pins the prompt's blocks until the decode worker has pulled them. If the decode side dies or
never pulls, nobody would ever free them: each pin carries an expiry and a reaper frees what lapsed. Release is
idempotent (ReleaseKV RPC, NIXL notification and the reaper may all race for the same lease).
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable


@dataclass
class Lease:
    lease_id: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    expiry: float  # time.time() seconds


class LeaseTable:
    def __init__(self, ttl_s: float = 30.0):
        self.ttl_s = ttl_s
        self._by_id: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str, block_ids: list[int], num_tokens: int, ttl_s: float | None = None) -> Lease:
        lease = Lease(uuid.uuid4().hex, request_id, list(block_ids), num_tokens,
                      time.time() + (self.ttl_s if ttl_s is None else ttl_s))
        with self._lock:
            self._by_id[lease.lease_id] = lease
        return lease

    def pop(self, lease_id: str = "", request_id: str = "") -> Lease | None:
        """Remove and return the lease (by id, else by request id); None if it is already gone."""
        with self._lock:
            if lease_id:
                return self._by_id.pop(lease_id, None)
            for lid, l in list(self._by_id.items()):
                if l.request_id == request_id:
                    return self._by_id.pop(lid)
        return None

    def pop_expired(self, now: float | None = None) -> list[Lease]:
        now = time.time() if now is None else now
        with self._lock:
            gone = [l for l in self._by_id.values() if l.expiry <= now]
            for l in gone:
                del self._by_id[l.lease_id]
        return gone

    def pinned_blocks(self) -> int:
        with self._lock:
            return sum(b >= 0 for l in self._by_id.values() for b in l.block_ids)  # -1: released, not pinned

    def __len__(self) -> int:
        return len(self._by_id)


async def reap_forever(table: LeaseTable, release: Callable[[Lease], Awaitable[None]], interval_s: float = 0.5,
                       on_reaped: Callable[[Lease], None] | None = None) -> None:
    """Free lapsed leases until cancelled."""
    while True:
        for lease in table.pop_expired():
            try:
                await release(lease)
            finally:
                if on_reaped:
                    on_reaped(lease)
        await asyncio.sleep(interval_s)
