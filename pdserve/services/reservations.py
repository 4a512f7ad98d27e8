"""The KV reservation ledger (spec §1.2 stage two; docs/admission.md): what a request reserves (`Plan`), and the
ledger that holds the reservations of every gateway replica.

A reservation is bookkeeping, not memory: `pdserve:{model}:reservations` (sorted set: request id -> lease expiry
in ms) and `pdserve:{model}:reservation_blocks` (hash: request id -> blocks). One Lua script prunes expired
leases, then admits the request if the reserved blocks + its own fit the capacity and the reserved requests + 1
fit the sequence slots, all atomically, so every gateway replica sees one ledger. A gateway renews the leases of
its live requests every `lease_s / 3`; a crashed gateway stops renewing and its reservations expire by
themselves.

Tenant shares (spec §1.2 "租户配额", §5.5, Q22; docs/admission.md, "Tenant KV shares"): a tenant may have a
guaranteed share g (fraction of the capacity) and a cap m (default 1). `pdserve:{model}:reservation_tenant`
(request id -> tenant), `pdserve:{model}:kv_guarantee` (tenant -> g, as last sent by its requests) and
`pdserve:{model}:kv_active` (sorted set: tenant -> active until, ms) let the same script admit tenant t's B blocks
only if, with C the capacity, R the blocks reserved, R_u tenant u's, and A the active tenants (holding a
reservation, or asked for one within their `kv_idle_s`):

    R + B + sum over u in A, u != t of max(0, floor(g_u C) - R_u)  <=  C      (others' unused guarantees held back)
    R_t + B  <=  floor(m_t C)                                                  (its cap)

Sequence slots are held back the same way (`fair_slots`: floor(g_u S) of the S slots per active tenant u).
An active tenant therefore always finds its unused guarantee free; an idle tenant's guarantee is surplus anyone
may borrow, given back as the borrowers' reservations end (the borrower cannot re-reserve it once the owner is
active again). Without shares (g = 0, m = 1, as for every tenant not configured) the rule is the old one.

Redis down: a process-local ledger with the same rules takes over (each replica then admits up to the whole
capacity: degraded, counted in `pdserve_admission_degraded_total`); live reservations are written back to
Redis by the renew loop when it returns, so the ledger recovers after a Redis restart.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.services.kv_shares import NO_SHARE, KVShare, fair_free, fair_slots
from pdserve.services.metrics import gateway as M

if TYPE_CHECKING:
    from pdserve.services.admission import Capacity

log = logging.getLogger("pdserve.admission")


def _unpin_lua(refs: int, holders: int) -> str:
    """A Lua `unpin(rid)`: drop the request's pins (KEYS[holders]: rid -> its pin keys, space-separated), and
    each pin no other request holds (KEYS[refs]: pin key -> holders)."""
    return f"""
local function unpin(rid)
  local ks = redis.call('HGET', KEYS[{holders}], rid)
  if not ks then return end
  redis.call('HDEL', KEYS[{holders}], rid)
  for k in string.gmatch(ks, '%S+') do
    if redis.call('HINCRBY', KEYS[{refs}], k, -1) <= 0 then redis.call('HDEL', KEYS[{refs}], k) end
  end
end
"""


# KEYS: zset, hash, rid -> tenant, tenant -> guarantee, tenant -> active until, pin -> holders, rid -> pins.
# ARGV: rid, prompt_blocks, blocks_per_copy, n, min_copies, cap_blocks, seq_limit, lease_ms, tenant, guaranteed,
# max_share, idle_ms, cap_seqs (the sequence slots; the guarantees hold back slots the same way, `fair_slots`),
# pins (the prefix-cache hit's pin keys, space-separated; prefix_pins.py).
# Reserves prompt + k x per-copy blocks, + the pins no live reservation holds yet, for the largest k <= n that
# fits (k >= min_copies) within the tenant rule above, in one call: the same arithmetic as `largest_copies` and
# `fair_free`. Every pin held counts one block, once. Returns {k (0: nothing reserved), used_blocks, used_seqs}
# (after the call).
RESERVE_LUA = _unpin_lua(6, 7) + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, rid in ipairs(expired) do
  redis.call('ZREM', KEYS[1], rid)
  redis.call('HDEL', KEYS[2], rid)
  redis.call('HDEL', KEYS[3], rid)
  unpin(rid)
end
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
local me, cap = ARGV[9], tonumber(ARGV[6])
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[12]), me)  -- asking makes a tenant active
redis.call('HSET', KEYS[4], me, ARGV[10])
local tenant_of = {}
local tv = redis.call('HGETALL', KEYS[3])
for i = 1, #tv, 2 do tenant_of[tv[i]] = tv[i + 1] end
local used, by, nby = 0, {}, {}
local bv = redis.call('HGETALL', KEYS[2])
for i = 1, #bv, 2 do
  local b, u = tonumber(bv[i + 1]), tenant_of[bv[i]] or ''
  used = used + b
  by[u] = (by[u] or 0) + b
  nby[u] = (nby[u] or 0) + 1
end
local seqs = redis.call('ZCARD', KEYS[1])
local mine = redis.call('HGET', KEYS[2], ARGV[1])
if mine then  -- reserving again replaces its own entry (as LocalLedger.reserve_plan does)
  local u = tenant_of[ARGV[1]] or ''
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
  used = used - tonumber(mine)
  by[u] = by[u] - tonumber(mine)
  nby[u] = nby[u] - 1
  seqs = seqs - 1
end
unpin(ARGV[1])
used = used + redis.call('HLEN', KEYS[6])
local pins, fresh = {}, 0
for k in string.gmatch(ARGV[14] or '', '%S+') do
  pins[#pins + 1] = k
  if redis.call('HEXISTS', KEYS[6], k) == 0 then fresh = fresh + 1 end
end
local active = {}
for _, u in ipairs(redis.call('ZRANGE', KEYS[5], 0, -1)) do active[u] = true end
for u, c in pairs(nby) do if c > 0 then active[u] = true end end
local owed, owed_seqs, cap_seqs = 0, 0, tonumber(ARGV[13])
for u, _ in pairs(active) do
  if u ~= me then
    local g = tonumber(redis.call('HGET', KEYS[4], u) or '0')
    local short = math.floor(g * cap) - (by[u] or 0)
    if short > 0 then owed = owed + short end
    short = math.floor(g * cap_seqs) - (nby[u] or 0)
    if short > 0 then owed_seqs = owed_seqs + short end
  end
end
local pb, per, n, mink = tonumber(ARGV[2]) + fresh, tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if seqs + 1 > tonumber(ARGV[7]) or seqs + 1 + owed_seqs > cap_seqs then
  return {0, used, seqs}
end
local room = math.min(cap - used - owed, math.floor(tonumber(ARGV[11]) * cap) - (by[me] or 0)) - pb
if room < 0 then
  return {0, used, seqs}
end
local k = n
if per > 0 then k = math.min(n, math.floor(room / per)) end
if k < mink then
  return {0, used, seqs}
end
local blocks = pb - fresh + k * per  -- its own; the fresh pins count in the pin hash
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[8]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], blocks)
redis.call('HSET', KEYS[3], ARGV[1], me)
if #pins > 0 then
  redis.call('HSET', KEYS[7], ARGV[1], ARGV[14])
  for _, p in ipairs(pins) do redis.call('HINCRBY', KEYS[6], p, 1) end
end
return {k, used + blocks + fresh, seqs + 1}
"""

# KEYS: zset, hash, rid -> tenant, pin -> holders, rid -> pins. ARGV: lease_ms, then rid, blocks, tenant, pins
# quadruples. Re-adds missing ones, pins included (after a Redis restart).
RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #ARGV, 4 do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 2])
  if ARGV[i + 3] ~= '' and redis.call('HEXISTS', KEYS[5], ARGV[i]) == 0 then
    redis.call('HSET', KEYS[5], ARGV[i], ARGV[i + 3])
    for k in string.gmatch(ARGV[i + 3], '%S+') do redis.call('HINCRBY', KEYS[4], k, 1) end
  end
end
return 1
"""

# KEYS: zset, hash, rid -> tenant, pin -> holders, rid -> pins.
RELEASE_LUA = _unpin_lua(4, 5) + """
unpin(ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return redis.call('HDEL', KEYS[2], ARGV[1])
"""

# The request's prefix-cache hit is gone (placed elsewhere before its prefill): its pins become its own blocks
# (ARGV[2]), kept whatever the load (it is admitted). KEYS as RELEASE_LUA's.
UNPIN_LUA = _unpin_lua(4, 5) + """
unpin(ARGV[1])
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
return 1
"""

# Prune, then report {blocks reserved (pins once each), requests reserved}. KEYS as RELEASE_LUA's.
USAGE_LUA = _unpin_lua(4, 5) + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('ZREM', KEYS[1], rid)
  redis.call('HDEL', KEYS[2], rid)
  redis.call('HDEL', KEYS[3], rid)
  unpin(rid)
end
local used = redis.call('HLEN', KEYS[4])
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
        self.tenant_of: dict[str, str] = {}
        self.guarantees: dict[str, float] = {}
        self.active_until: dict[str, float] = {}
        self.pins: dict[str, int] = {}  # pin key -> reservations holding it (each pin is one block, counted once)
        self.pins_of: dict[str, tuple[str, ...]] = {}
        self.clock = clock

    def _unpin(self, rid: str) -> None:
        for k in self.pins_of.pop(rid, ()):
            self.pins[k] -= 1
            if self.pins[k] <= 0:
                del self.pins[k]

    def _pin(self, rid: str, pins: tuple[str, ...]) -> None:
        if pins:
            self.pins_of[rid] = tuple(pins)
            for k in pins:
                self.pins[k] = self.pins.get(k, 0) + 1

    def _prune(self) -> None:
        now = self.clock()
        for rid in [r for r, (_, exp) in self.entries.items() if exp <= now]:
            del self.entries[rid]
            self.tenant_of.pop(rid, None)
            self._unpin(rid)
        for u in [u for u, t in self.active_until.items() if t <= now]:
            del self.active_until[u]

    def reserve_plan(self, rid: str, plan: Plan, cap: Capacity, seq_limit: int,
                     lease_s: float, share: KVShare = NO_SHARE, pins: tuple[str, ...] = ()) -> tuple[int, int, int]:
        """RESERVE_LUA's rule: (copies reserved, 0 = none; blocks reserved; requests reserved), after the call.
        `pins`: the prefix-cache hit's pin keys (prefix_pins.py); those no reservation holds yet count as its
        prompt blocks, the rest are already counted."""
        self._prune()
        self.active_until[share.tenant] = self.clock() + share.idle_s
        self.guarantees[share.tenant] = share.guaranteed
        self.entries.pop(rid, None)
        self.tenant_of.pop(rid, None)
        self._unpin(rid)
        used, seqs = sum(b for b, _ in self.entries.values()) + len(self.pins), len(self.entries)
        fresh = sum(1 for k in pins if k not in self.pins)
        own_plan = plan
        plan = Plan(plan.prompt_blocks + fresh, plan.blocks_per_copy, plan.n, plan.min_copies)
        by: dict[str, int] = {}
        n_by: dict[str, int] = {}
        for r, (b, _) in self.entries.items():
            u = self.tenant_of.get(r, "")
            by[u] = by.get(u, 0) + b
            n_by[u] = n_by.get(u, 0) + 1
        active = set(self.active_until)
        free = fair_free(cap.blocks, by, self.guarantees, active, share)
        slots = fair_slots(cap.seqs, n_by, self.guarantees, active, share)
        k = largest_copies(free, plan) if seqs + 1 <= seq_limit and slots >= 1 else 0
        if k == 0:
            return 0, used, seqs
        self.entries[rid] = (own_plan.blocks(k), self.clock() + lease_s)
        self.tenant_of[rid] = share.tenant
        self._pin(rid, pins)
        return k, used + plan.blocks(k), seqs + 1

    def reserve(self, rid: str, blocks: int, cap: Capacity, lease_s: float, share: KVShare = NO_SHARE) -> bool:
        return self.reserve_plan(rid, Plan(blocks, 0, 1, 1), cap, cap.seqs, lease_s, share)[0] > 0

    def renew(self, held: dict[str, int], lease_s: float, tenants: dict[str, str] | None = None,
              pins: dict[str, tuple[str, ...]] | None = None) -> None:
        for rid, b in held.items():
            self.entries[rid] = (b, self.clock() + lease_s)
            self.tenant_of[rid] = (tenants or {}).get(rid, "")
            if rid not in self.pins_of:
                self._pin(rid, (pins or {}).get(rid, ()))

    def release(self, rid: str) -> None:
        self.entries.pop(rid, None)
        self.tenant_of.pop(rid, None)
        self._unpin(rid)

    def unpin(self, rid: str, blocks: int) -> None:
        """UNPIN_LUA: the hit is gone; its pins become `blocks` of its own."""
        self._unpin(rid)
        if rid in self.entries:
            self.entries[rid] = (blocks, self.entries[rid][1])

    def usage(self) -> tuple[int, int]:
        self._prune()
        return sum(b for b, _ in self.entries.values()) + len(self.pins), len(self.entries)


class ReservationLedger:
    """Redis-held reservations with leases; falls back to a LocalLedger while Redis is unreachable."""

    def __init__(self, redis, model: str, lease_s: float = 10.0):
        self.redis = redis
        self.lease_s = lease_s
        self.zkey = f"pdserve:{model}:reservations"
        self.hkey = f"pdserve:{model}:reservation_blocks"
        self.tkey = f"pdserve:{model}:reservation_tenant"
        self.gkey = f"pdserve:{model}:kv_guarantee"
        self.akey = f"pdserve:{model}:kv_active"
        self.pkey = f"pdserve:{model}:prefix_pins"        # pin key -> reservations holding it
        self.rpkey = f"pdserve:{model}:reservation_pins"  # request id -> its pin keys
        self.local = LocalLedger()
        if redis is not None:
            self._reserve = redis.register_script(RESERVE_LUA)
            self._renew = redis.register_script(RENEW_LUA)
            self._release = redis.register_script(RELEASE_LUA)
            self._unpin = redis.register_script(UNPIN_LUA)
            self._usage = redis.register_script(USAGE_LUA)

    @property
    def _keys(self) -> list[str]:  # RENEW / RELEASE / UNPIN / USAGE
        return [self.zkey, self.hkey, self.tkey, self.pkey, self.rpkey]

    def _degraded(self, what: str, e: Exception) -> None:
        M.ADMISSION_DEGRADED.inc()
        log.warning("admission: Redis unavailable during %s (%s); using the local ledger", what, e)

    async def reserve_plan(self, rid: str, plan: Plan, cap: Capacity, seq_limit: int,
                           share: KVShare = NO_SHARE, pins: tuple[str, ...] = ()) -> tuple[int, int, int]:
        """One script call: (copies reserved, 0 = none; blocks reserved; requests reserved) across replicas.
        `pins`: the prefix-cache hit's pin keys (prefix_pins.py), not in `plan.prompt_blocks`."""
        if self.redis is not None:
            try:
                k, used, seqs = await self._reserve(
                    keys=[self.zkey, self.hkey, self.tkey, self.gkey, self.akey, self.pkey, self.rpkey],
                    args=[rid, plan.prompt_blocks, plan.blocks_per_copy, plan.n, plan.min_copies, cap.blocks,
                          seq_limit, int(self.lease_s * 1000), share.tenant, repr(float(share.guaranteed)),
                          repr(float(share.max_share)), int(share.idle_s * 1000), cap.seqs, " ".join(pins)])
                return int(k), int(used), int(seqs)
            except Exception as e:  # noqa: BLE001
                self._degraded("reserve", e)
        return self.local.reserve_plan(rid, plan, cap, seq_limit, self.lease_s, share, pins)

    async def reserve(self, rid: str, blocks: int, cap: Capacity, share: KVShare = NO_SHARE) -> bool:
        return (await self.reserve_plan(rid, Plan(blocks, 0, 1, 1), cap, cap.seqs, share))[0] > 0

    async def renew(self, held: dict[str, int], tenants: dict[str, str] | None = None,
                    pins: dict[str, tuple[str, ...]] | None = None) -> None:
        if not held:
            return
        if self.redis is not None:
            try:
                args: list = [int(self.lease_s * 1000)]
                for rid, b in held.items():
                    args += [rid, b, (tenants or {}).get(rid, ""), " ".join((pins or {}).get(rid, ()))]
                await self._renew(keys=self._keys, args=args)
                return
            except Exception as e:  # noqa: BLE001
                self._degraded("renew", e)
        self.local.renew(held, self.lease_s, tenants, pins)

    async def release(self, rid: str) -> None:
        self.local.release(rid)
        if self.redis is not None:
            try:
                await self._release(keys=self._keys, args=[rid])
            except Exception as e:  # noqa: BLE001 - the lease expires by itself
                self._degraded("release", e)

    async def unpin(self, rid: str, blocks: int) -> None:
        """The request's hit is gone: its pins become `blocks` of its own (its whole reservation now)."""
        self.local.unpin(rid, blocks)
        if self.redis is not None:
            try:
                await self._unpin(keys=self._keys, args=[rid, blocks])
            except Exception as e:  # noqa: BLE001 - the renew loop writes `blocks` back
                self._degraded("unpin", e)

    async def usage(self) -> tuple[int, int]:
        """(blocks reserved, requests reserved) across every replica."""
        if self.redis is not None:
            try:
                b, n = await self._usage(keys=self._keys)
                return int(b), int(n)
            except Exception as e:  # noqa: BLE001
                self._degraded("usage", e)
        return self.local.usage()
