"""The KV reservation ledger (spec §1.2 stage two; docs/admission.md): what a request reserves (`Plan`), and the
ledger that holds the reservations of every gateway replica.

A reservation is bookkeeping, not memory: `pdserve:{model}:reservations` (sorted set: request id -> lease expiry
in ms) and `pdserve:{model}:reservation_blocks` (hash: request id -> blocks). One Lua script prunes expired
leases, then admits the request if the reserved blocks + its own fit the capacity and the reserved requests + 1
fit the sequence slots, all atomically, so every gateway replica sees one ledger. A gateway renews the leases of
its live requests every `lease_s / 3`; a crashed gateway stops renewing and its reservations expire by
themselves.

Redis down: a process-local ledger with the same rules takes over (each replica then admits up to the whole
capacity: degraded, counted in `pdserve_admission_degraded_total`); live reservations are written back to
Redis by the renew loop when it returns, so the ledger recovers after a Redis restart.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.services.metrics import gateway as M

if TYPE_CHECKING:
    from pdserve.services.admission import Capacity

log = logging.getLogger("pdserve.admission")

# KEYS: zset, hash. ARGV: rid, prompt_blocks, blocks_per_copy, n, min_copies, cap_blocks, seq_limit, lease_ms.
# Reserves prompt + k x per-copy blocks for the largest k <= n that fits (k >= min_copies), in one call: the same
# arithmetic as `largest_copies`. Returns {k (0: nothing reserved), used_blocks, used_seqs} (after the call).
RESERVE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, rid in ipairs(expired) do
  redis.call('ZREM', KEYS[1], rid)
  redis.call('HDEL', KEYS[2], rid)
end
local used = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do used = used + tonumber(v) end
local seqs = redis.call('ZCARD', KEYS[1])
local mine = redis.call('HGET', KEYS[2], ARGV[1])
if mine then  -- reserving again replaces its own entry (as LocalLedger.reserve_plan does)
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  used = used - tonumber(mine)
  seqs = seqs - 1
end
local pb, per, n, mink = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if seqs + 1 > tonumber(ARGV[7]) then
  return {0, used, seqs}
end
local room = tonumber(ARGV[6]) - used - pb
if room < 0 then
  return {0, used, seqs}
end
local k = n
if per > 0 then k = math.min(n, math.floor(room / per)) end
if k < mink then
  return {0, used, seqs}
end
local blocks = pb + k * per
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[8]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], blocks)
return {k, used + blocks, seqs + 1}
"""

# KEYS: zset, hash. ARGV: lease_ms, then rid, blocks pairs. Re-adds missing ones (after a Redis restart).
RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #ARGV, 2 do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
return 1
"""

RELEASE_LUA = """
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('HDEL', KEYS[2], ARGV[1])
"""

# Prune, then report {blocks reserved, requests reserved}.
USAGE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('ZREM', KEYS[1], rid)
  redis.call('HDEL', KEYS[2], rid)
end
local used = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do used = used + tonumber(v) end
return {used, redis.call('ZCARD', KEYS[1])}
"""


@dataclass(frozen=True)
class Plan:
    """What a request reserves: the prompt's blocks once + `blocks_per_copy` for each of k copies, for the
    largest k <= n that fits, and at least `min_copies` (n when degrading is not allowed, else 1)."""
    prompt_blocks: int
    blocks_per_copy: int
    n: int
    min_copies: int

    def blocks(self, k: int) -> int:
        return self.prompt_blocks + k * self.blocks_per_copy


def largest_copies(free_blocks: int, plan: Plan) -> int:
    """The most copies whose reservation fits `free_blocks`, computed, not searched (RESERVE_LUA does the same
    arithmetic); 0 when not even `plan.min_copies` fit."""
    room = free_blocks - plan.prompt_blocks
    if room < 0:
        return 0
    k = plan.n if plan.blocks_per_copy == 0 else min(plan.n, room // plan.blocks_per_copy)
    return k if k >= plan.min_copies else 0


class LocalLedger:
    """The reservation ledger in process memory (no Redis, or Redis unreachable). `clock` is injectable so the
    simulator (`pdserve.sim.admission`) runs this very ledger on virtual time."""

    def __init__(self, clock=time.monotonic):
        self.entries: dict[str, tuple[int, float]] = {}  # rid -> (blocks, expiry on `clock`)
        self.clock = clock

    def _prune(self) -> None:
        now = self.clock()
        for rid in [r for r, (_, exp) in self.entries.items() if exp <= now]:
            del self.entries[rid]

    def reserve_plan(self, rid: str, plan: Plan, cap: Capacity, seq_limit: int,
                     lease_s: float) -> tuple[int, int, int]:
        """RESERVE_LUA's rule: (copies reserved, 0 = none; blocks reserved; requests reserved), after the call."""
        self._prune()
        self.entries.pop(rid, None)
        used, seqs = sum(b for b, _ in self.entries.values()), len(self.entries)
        k = largest_copies(cap.blocks - used, plan) if seqs + 1 <= seq_limit else 0
        if k == 0:
            return 0, used, seqs
        self.entries[rid] = (plan.blocks(k), self.clock() + lease_s)
        return k, used + plan.blocks(k), seqs + 1

    def reserve(self, rid: str, blocks: int, cap: Capacity, lease_s: float) -> bool:
        return self.reserve_plan(rid, Plan(blocks, 0, 1, 1), cap, cap.seqs, lease_s)[0] > 0

    def renew(self, held: dict[str, int], lease_s: float) -> None:
        for rid, b in held.items():
            self.entries[rid] = (b, self.clock() + lease_s)

    def release(self, rid: str) -> None:
        self.entries.pop(rid, None)

    def usage(self) -> tuple[int, int]:
        self._prune()
        return sum(b for b, _ in self.entries.values()), len(self.entries)


class ReservationLedger:
    """Redis-held reservations with leases; falls back to a LocalLedger while Redis is unreachable."""

    def __init__(self, redis, model: str, lease_s: float = 10.0):
        self.redis = redis
        self.lease_s = lease_s
        self.zkey = f"pdserve:{model}:reservations"
        self.hkey = f"pdserve:{model}:reservation_blocks"
        self.local = LocalLedger()
        if redis is not None:
            self._reserve = redis.register_script(RESERVE_LUA)
            self._renew = redis.register_script(RENEW_LUA)
            self._release = redis.register_script(RELEASE_LUA)
            self._usage = redis.register_script(USAGE_LUA)

    def _degraded(self, what: str, e: Exception) -> None:
        M.ADMISSION_DEGRADED.inc()
        log.warning("admission: Redis unavailable during %s (%s); using the local ledger", what, e)

    async def reserve_plan(self, rid: str, plan: Plan, cap: Capacity, seq_limit: int) -> tuple[int, int, int]:
        """One script call: (copies reserved, 0 = none; blocks reserved; requests reserved) across replicas."""
        if self.redis is not None:
            try:
                k, used, seqs = await self._reserve(
                    keys=[self.zkey, self.hkey],
                    args=[rid, plan.prompt_blocks, plan.blocks_per_copy, plan.n, plan.min_copies, cap.blocks,
                          seq_limit, int(self.lease_s * 1000)])
                return int(k), int(used), int(seqs)
            except Exception as e:  # noqa: BLE001
                self._degraded("reserve", e)
        return self.local.reserve_plan(rid, plan, cap, seq_limit, self.lease_s)

    async def reserve(self, rid: str, blocks: int, cap: Capacity) -> bool:
        return (await self.reserve_plan(rid, Plan(blocks, 0, 1, 1), cap, cap.seqs))[0] > 0

    async def renew(self, held: dict[str, int]) -> None:
        if not held:
            return
        if self.redis is not None:
            try:
                args: list = [int(self.lease_s * 1000)]
                for rid, b in held.items():
                    args += [rid, b]
                await self._renew(keys=[self.zkey, self.hkey], args=args)
                return
            except Exception as e:  # noqa: BLE001
                self._degraded("renew", e)
        self.local.renew(held, self.lease_s)

    async def release(self, rid: str) -> None:
        self.local.release(rid)
        if self.redis is not None:
            try:
                await self._release(keys=[self.zkey, self.hkey], args=[rid])
            except Exception as e:  # noqa: BLE001 - the lease expires by itself
                self._degraded("release", e)

    async def usage(self) -> tuple[int, int]:
        """(blocks reserved, requests reserved) across every replica."""
        if self.redis is not None:
            try:
                b, n = await self._usage(keys=[self.zkey, self.hkey])
                return int(b), int(n)
            except Exception as e:  # noqa: BLE001
                self._degraded("usage", e)
        return self.local.usage()
