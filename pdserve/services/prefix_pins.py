"""Prefix-cache hits at admission (spec §1.2 stage two, §0.1: the cache lookup comes before the reservation).

The router places a request and says how many of its prompt tokens the placed worker already holds
(`RouteResponse.cached_tokens`). Those blocks need no new memory, but while requests use them they are pinned
(not evictable), so the ledger counts them: once, however many requests hold them. Each full block of the hit is
a *pin* keyed by the worker and the chained hash of the prompt up to that block (namespace included, as the
engine salts its block hashes); a request reserves its own blocks (prompt less the hit, plus the output) and
the pins no live reservation holds yet. Two requests sharing a prefix on one worker share its pins.

The keys are the gateway's own (blake2b over the token ids), not the engine's block hashes: they only have to
agree between gateway replicas, which they do for the same worker, namespace and tokens.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixHit:
    """What the placement said: `worker_id` holds the first `cached_tokens` tokens of `prompt` in `namespace`."""
    worker_id: str
    namespace: str
    prompt: tuple[int, ...]
    cached_tokens: int

    def pins(self, block_size: int) -> tuple[str, ...]:
        """One key per full block of the hit, in prompt order (a key depends on every token before it)."""
        n = min(max(0, self.cached_tokens), len(self.prompt)) // block_size
        h = hashlib.blake2b(f"{self.worker_id}\0{self.namespace}\0{block_size}".encode(), digest_size=16).digest()
        out = []
        for i in range(n):
            block = self.prompt[i * block_size:(i + 1) * block_size]
            h = hashlib.blake2b(h + b"".join(t.to_bytes(4, "little", signed=True) for t in block),
                                digest_size=16).digest()
            out.append(h.hex())  # the worker is in the chain: no separator to escape in the ledger
        return tuple(out)


def kv_holder(route) -> str:
    """The worker whose KV blocks a placement (a RouteResponse) holds for the request: the one decoding."""
    return route.both.worker_id if route.mode == "colocated" else route.decode.worker_id


def hit_of(route, namespace: str, prompt) -> PrefixHit | None:
    """The placement's hit on that worker: colocated, its prefix-cache hit; disaggregated, the decode worker's own
    (it pulls only the blocks after it, decode/pull_plan.py); the prefill worker's KV is not reserved."""
    n = route.cached_tokens if route.mode == "colocated" else route.decode_cached_tokens
    return PrefixHit(kv_holder(route), namespace, tuple(prompt), n) if n > 0 else None
