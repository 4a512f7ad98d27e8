"""Tenant-fair prefix-cache eviction (spec §1.2, §5.5, Q22; docs/engine.md, "Tenant-fair eviction").

Each namespace (a tenant's prefix-cache namespace, `tenant:<name>` or its shared one) may have a guaranteed share
g of this worker's KV blocks: floor(g x num_blocks) blocks it is allowed to keep. A namespace *holds* the blocks
it took (in use by its sequences) plus its cached, unreferenced blocks. An allocation for namespace A may evict
a cached block of namespace B only when B == A (a tenant's own churn) or B holds more than its guarantee (the
surplus it borrowed while others were idle). So one tenant's churn never pushes another below its share; what
is above it is borrowable and is reclaimed LRU-first.

The shares come with the requests (the gateway puts the tenant's `kv_share` from the keys file into the
request's `Lifecycle`; the worker records the latest value per namespace before adding the request). A namespace
never told a share has guarantee 0: plain LRU, the behaviour before this.
"""
from __future__ import annotations

from collections import Counter


class KVShares:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.share: dict[str, float] = {}   # namespace -> guaranteed fraction (only those > 0)
        self.held: Counter[str] = Counter()    # blocks a namespace holds: referenced + cached unreferenced
        self.cached: Counter[str] = Counter()  # of those, cached and unreferenced (evictable)

    @property
    def active(self) -> bool:
        return bool(self.share)

    def set(self, namespace: str, fraction: float) -> None:
        f = min(1.0, max(0.0, float(fraction)))
        if f > 0:
            self.share[namespace] = f
        else:
            self.share.pop(namespace, None)

    def floor(self, namespace: str) -> int:
        return int(self.share.get(namespace, 0.0) * self.num_blocks)

    def may_evict(self, victim: str, taker: str) -> bool:
        return victim == taker or self.held[victim] > self.floor(victim)

    def locked_against(self, taker: str) -> int:
        """Cached blocks `taker` may not evict: each other namespace's cached blocks beyond its surplus."""
        locked = 0
        for ns in self.share:
            if ns != taker:
                surplus = max(0, self.held[ns] - self.floor(ns))
                locked += self.cached[ns] - min(self.cached[ns], surplus)
        return locked

    def guaranteed_others(self, taker: str) -> int:
        return sum(self.floor(ns) for ns in self.share if ns != taker)
