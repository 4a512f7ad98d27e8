"""Which worker holds which prompt prefix: an in-memory index fed by the workers' KV events, mirrored in Redis.

Redis is the source of truth so any number of routers agree and a restarted router rebuilds:

- `pdserve:{model}:kvblocks:{worker_id}` set of `"{hash:x}:{namespace}"` - the blocks a worker's prefix cache
  holds. The worker updates it and appends to the stream in ONE transaction, so a snapshot of the set plus the
  stream entries after it always replay to the true state (each (worker, block) ends at its last event).
  The worker refreshes a TTL on it; a dead worker's set disappears by itself.
- `pdserve:{model}:kv_events` stream, fields `w` (worker id) and `e` (newline-separated `+hash:ns` / `-hash:ns`,
  in the engine's order) or `r` (reset: the worker (re)started with an empty cache). Capped with MAXLEN.
  `+hash@host:ns` / `+hash@disk:ns`: the block moved to the worker's host / disk KV tier (engine/kv_offload.py);
  `-hash:ns`: it left every tier. The index keeps each (worker, block)'s tier: a hit in an offload tier costs a
  recall (router/cost.py), cheaper than recomputing but not free.

Why not `prefix:{ns}:{hash} -> set(worker ids)` (the DESIGN.md sketch): a router needs the whole index in memory
anyway (lookups must not pay a Redis round trip per block), and per-worker sets make the two operations that
matter - rebuild one worker, forget a dead worker - O(that worker's blocks) instead of a keyspace scan.

A lookup computes the prompt's chained block hashes with the engine's own `block_hash` (never reimplemented) and
returns, per worker, how many leading tokens its cache holds. Like the engine, the block holding the last
prompt token never counts (the engine recomputes it to get the first token's logits).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from pdserve.engine.block_manager import block_hash
from pdserve.services.kv_events import blocks_key, parse_member_tier, stream_key

log = logging.getLogger("pdserve.router.index")

Key = tuple[str, int]  # (namespace, chained block hash)


@dataclass
class TierHit:
    """A worker's leading prefix hit, in blocks, split by the tier holding each block."""
    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.host + self.disk


def chain_hashes(tokens: list[int], block_size: int, fingerprint: str, namespace: str) -> list[int]:
    """The engine's prefix-cache keys for the full blocks of `tokens` that a lookup could hit."""
    out: list[int] = []
    parent = None
    for i in range(max(0, (len(tokens) - 1) // block_size)):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size], fingerprint, namespace)
        out.append(parent)
    return out


class PrefixIndex:
    """The in-memory index (one per router process). Not thread-safe: used from the router's event loop."""

    def __init__(self):
        self.holders: dict[Key, set[str]] = {}
        self.by_worker: dict[str, set[Key]] = {}
        self.offloaded: dict[tuple[str, Key], str] = {}  # (worker, key) -> "host" | "disk"; absent: device

    def __len__(self) -> int:
        return len(self.holders)

    def add(self, worker: str, key: Key, tier: str = "device") -> None:
        self.holders.setdefault(key, set()).add(worker)
        self.by_worker.setdefault(worker, set()).add(key)
        if tier == "device":
            self.offloaded.pop((worker, key), None)
        else:
            self.offloaded[(worker, key)] = tier

    def tier(self, worker: str, key: Key) -> str | None:
        if worker not in self.holders.get(key, ()):
            return None
        return self.offloaded.get((worker, key), "device")

    def remove(self, worker: str, key: Key) -> None:
        self.offloaded.pop((worker, key), None)
        s = self.holders.get(key)
        if s is not None:
            s.discard(worker)
            if not s:
                del self.holders[key]
        w = self.by_worker.get(worker)
        if w is not None:
            w.discard(key)

    def drop_worker(self, worker: str) -> int:
        keys = self.by_worker.pop(worker, set())
        for k in keys:
            self.offloaded.pop((worker, k), None)
            s = self.holders.get(k)
            if s is not None:
                s.discard(worker)
                if not s:
                    del self.holders[k]
        return len(keys)

    def load_worker(self, worker: str, keys: Iterable[Key | tuple[str, int, str]]) -> None:
        """keys: (namespace, hash) on the device, or (namespace, hash, tier)."""
        self.drop_worker(worker)
        self.by_worker[worker] = set()
        for k in keys:
            self.add(worker, (k[0], k[1]), k[2] if len(k) > 2 else "device")

    def workers(self) -> set[str]:
        return set(self.by_worker)

    def match(self, hashes: list[int], namespace: str, workers: Iterable[str]) -> dict[str, int]:
        """Per worker, how many leading blocks of `hashes` it holds (a chain stops at its first miss)."""
        live = set(workers)
        out = {w: 0 for w in live}
        for i, h in enumerate(hashes):
            s = self.holders.get((namespace, h))
            still = live & s if s else set()
            if not still:
                break
            for w in still:
                out[w] = i + 1
            live = still
        return out

    def match_tiers(self, hashes: list[int], namespace: str, workers: Iterable[str]) -> dict[str, TierHit]:
        """As `match`, with each worker's leading blocks counted by the tier that holds them."""
        out = {}
        for w, nb in self.match(hashes, namespace, workers).items():
            hit = TierHit()
            for h in hashes[:nb]:
                t = self.offloaded.get((w, (namespace, h)), "device")
                setattr(hit, t, getattr(hit, t) + 1)
            out[w] = hit
        return out


class IndexSync:
    """Router side: keeps a PrefixIndex equal to Redis - snapshot per worker, then the event stream."""

    def __init__(self, r: aioredis.Redis, model: str, index: PrefixIndex | None = None):
        self.r = r
        self.model = model
        self.index = index or PrefixIndex()
        self.last_id = "0-0"
        self.events_applied = 0
        self._started = False
        self._checked_gap = 0.0

    async def start(self) -> None:
        """Remember where the stream ends BEFORE any snapshot, so nothing between the two is missed."""
        last = await self.r.xrevrange(stream_key(self.model), count=1)
        self.last_id = last[0][0].decode() if last else "0-0"
        self._started = True

    async def sync_workers(self, live: Iterable[str]) -> None:
        """Forget workers that are gone (dead: their heartbeat lapsed), load the ones not yet known."""
        if not self._started:
            await self.start()
        live = set(live)
        for w in self.index.workers() - live:
            n = self.index.drop_worker(w)
            log.info("worker %s left: dropped %d prefix blocks from the index", w, n)
        for w in live - self.index.workers():
            await self.load(w)

    async def load(self, worker: str) -> None:
        members = await self.r.smembers(blocks_key(self.model, worker))
        self.index.load_worker(worker, (parse_member_tier(m) for m in members))

    async def poll(self, block_ms: int | None = None, count: int = 2000) -> int:
        """Apply the stream entries after last_id. Returns the number of block events applied."""
        if not self._started:
            await self.start()
        res = await self.r.xread({stream_key(self.model): self.last_id}, count=count, block=block_ms)
        n = 0
        known = self.index.workers()
        for _stream, entries in res or []:
            for eid, fields in entries:
                self.last_id = eid.decode() if isinstance(eid, bytes) else eid
                w = fields[b"w"].decode()
                if b"r" in fields:
                    self.index.drop_worker(w)
                    if w in known:
                        self.index.by_worker[w] = set()
                    continue
                if w not in known:
                    continue  # not live (yet): its snapshot is loaded when it appears, events after replay
                for line in fields[b"e"].decode().split("\n"):
                    ns, h, tier = parse_member_tier(line[1:])
                    if line[0] == "+":
                        self.index.add(w, (ns, h), tier)
                    else:
                        self.index.remove(w, (ns, h))
                    n += 1
        self.events_applied += n
        await self._check_gap()
        return n

    async def _check_gap(self) -> None:
        # If this router fell behind by more than the stream keeps, entries were trimmed unseen: rebuild.
        now = time.monotonic()
        if now - self._checked_gap < 5.0:
            return
        self._checked_gap = now
        first = await self.r.xrange(stream_key(self.model), count=1)
        if first and _id_lt(self.last_id, first[0][0].decode()) and self.last_id != "0-0":
            log.warning("prefix index fell behind the trimmed event stream: rebuilding from snapshots")
            await self.rebuild()

    async def rebuild(self) -> None:
        workers = self.index.workers()
        await self.start()
        for w in workers:
            await self.load(w)


def _id_lt(a: str, b: str) -> bool:
    am, _, asq = a.partition("-")
    bm, _, bsq = b.partition("-")
    return (int(am), int(asq or 0)) < (int(bm), int(bsq or 0))
