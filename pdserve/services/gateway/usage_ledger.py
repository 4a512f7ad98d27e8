"""Usage records that survive their gateway (spec §1.7: exactly one terminal billing record per request).

The record is written where a request ends (lifecycle.py, `pdserve.billing`). A gateway replica SIGKILLed with
requests in flight would end none of them, and they would have no record at all. So each request's record is
*opened* durably at admission and *closed* at its terminal state; an open record whose replica died is finalised
by a live replica (the other one, or the same gateway restarted under a new replica id), state FAILED, marked with
`finalised_by`.

Redis keys (model `m`, replica id `r`, one random id per gateway process; `u` one per request):

    pdserve:m:usage:live:r      string with a TTL (LIVE_TTL_S), refreshed every REFRESH_S while r runs
    pdserve:m:usage:open:r      hash u -> OpenUsage (JSON): r's requests not yet closed
    pdserve:m:usage:replicas    set of the replica ids that have (or had) an open hash
    pdserve:m:usage:closed:u    tombstone (1 h) left by a replica that finalised u for a dead one

Exactly once, whoever gets there: closing and finalising both start by removing u from the open hash (a Lua
script, atomic), and only the one whose removal took it writes. The owner's close also writes when u is missing
without a tombstone — Redis lost it (restarted empty, or the open failed): the owner, alive, is the only one that
can bill it then. A finaliser sets the tombstone in the same script, so an owner that was only presumed dead (its
liveness lapsed: SIGSTOP, a Redis partition) finds it and does not write a second record.

The finalised record knows what admission knew (tenant, prompt tokens, times); the tokens the dead replica
streamed are not known, and are counted 0 (`emitted_tokens`, `committed_tokens`; billed = the prompt tokens).
Its quota is not charged (the tenant object lives in the dead process; the record is for the operator).

Redis unreachable: the open is skipped, and skipped at once for DOWN_S after a failure (the request is then billed
only if its own gateway lives to close it), and a failed close still writes the record; the refresher re-adds this replica's open entries when it finds its
registration gone (a restarted Redis), so they are covered again.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass

from pdserve.services.gateway.billing import BillingRecord, BillingTimes

log = logging.getLogger("pdserve.gateway.usage")

LIVE_TTL_S = 3.0   # a replica silent this long is dead for its records
REFRESH_S = 1.0    # its liveness refresh, and how often it looks for dead replicas' open records
TOMBSTONE_S = 3600
DOWN_S = 1.0       # after a failed open, opens are skipped this long (a Redis that is gone costs each request a timeout)

# KEYS: open hash, tombstone. ARGV: u. 1: the caller owns the close (write the record); 0: finalised elsewhere.
CLOSE_LUA = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
return 1
"""

# KEYS: open hash, tombstone. ARGV: u, tombstone ttl s. The entry (finalise it) or false (someone else did).
CLAIM_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], '1', 'EX', tonumber(ARGV[2]))
return v
"""


# KEYS: open hash, then one tombstone per entry. ARGV: u1, json1, u2, json2, ... Re-opens the entries that no
# finaliser took meanwhile (after a Redis restart, or after this replica was presumed dead and came back).
REOPEN_LUA = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then redis.call('HSET', KEYS[1], ARGV[2 * i - 3], ARGV[2 * i - 2]) end
end
return 0
"""


@dataclass
class OpenUsage:
    """What a record finalised for a dead replica is made of: what admission knew."""
    usage_id: str        # u: this ledger's key for the request (client ids need not be unique)
    request_id: str      # the completion id (the record's request_id)
    log_id: str          # the x-request-id its log lines carry
    tenant: str
    model: str
    prompt_tokens: int
    arrival: float
    deadline: float | None
    replica: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(raw: bytes | str) -> "OpenUsage":
        return OpenUsage(**json.loads(raw))

    def finalised_record(self, by: str) -> BillingRecord:
        """The billing record of a request its replica never ended: FAILED, its streamed tokens unknown (0)."""
        return BillingRecord(
            request_id=self.request_id, tenant=self.tenant, model=self.model, state="FAILED",
            times=BillingTimes(arrival=self.arrival, finished=time.time(), deadline=self.deadline),
            prompt_tokens=self.prompt_tokens,
            error=f"gateway replica {self.replica} ended before the request did (tokens it streamed unknown)",
            finalised_by=by)


class UsageLedger:
    """One per gateway process. `write(record, log_id)` is how a finalised record reaches the billing log."""

    def __init__(self, redis, model: str, write, replica: str | None = None):
        self.redis = redis
        self.model = model
        self.replica = replica or uuid.uuid4().hex[:12]
        self._write = write
        self._open: dict[str, OpenUsage] = {}  # this replica's, by usage id (re-added after a Redis restart)
        self._task: asyncio.Task | None = None
        self.finalised = 0  # records this replica finalised for dead ones
        self._down_until = 0.0  # monotonic: opens skipped until then (Redis just failed)
        self._close = redis.register_script(CLOSE_LUA)
        self._claim = redis.register_script(CLAIM_LUA)
        self._reopen = redis.register_script(REOPEN_LUA)

    def _key(self, what: str, rid: str) -> str:
        return f"pdserve:{self.model}:usage:{what}:{rid}"

    @property
    def _replicas(self) -> str:
        return f"pdserve:{self.model}:usage:replicas"

    def start(self) -> None:
        """The refresh / finalise loop (needs the running loop; idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # ---- a request's record -----------------------------------------------------------------------------------------
    async def open(self, u: OpenUsage) -> bool:
        """Durably open `u`'s record. False: Redis did not take it (its own close still writes)."""
        if time.monotonic() < self._down_until:
            return False
        try:
            async with self.redis.pipeline(transaction=True) as p:
                p.set(self._key("live", self.replica), "1", px=int(LIVE_TTL_S * 1000))
                p.sadd(self._replicas, self.replica)
                p.hset(self._key("open", self.replica), u.usage_id, u.to_json())
                await p.execute()
            self._open[u.usage_id] = u  # only what Redis took: the refresher re-opens these, `close` forgets them
            return True
        except Exception as e:  # noqa: BLE001 - Redis down: served anyway, billed by its own close
            self._down_until = time.monotonic() + DOWN_S
            log.warning("usage records not opened durably for %.0f s: %s", DOWN_S, e)
            return False

    async def close(self, usage_id: str) -> bool:
        """The request ended here: True when this replica writes its record (False: a finaliser already did)."""
        self._open.pop(usage_id, None)
        try:
            return bool(await self._close(keys=[self._key("open", self.replica), self._key("closed", usage_id)],
                                          args=[usage_id]))
        except Exception as e:  # noqa: BLE001 - cannot ask: the owner bills (a finaliser needs us dead AND this)
            log.warning("usage record %s: close not recorded in Redis (%s); writing it", usage_id, e)
            return True

    # ---- replicas -------------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
                await self.finalise_dead()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Redis blip: next round
                log.warning("usage ledger round failed: %s", e)
            await asyncio.sleep(REFRESH_S)

    async def refresh(self) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.set(self._key("live", self.replica), "1", px=int(LIVE_TTL_S * 1000))
            p.sadd(self._replicas, self.replica)
            added, = (await p.execute())[1:]
        if added and self._open:  # our registration was gone (Redis restarted empty): cover our requests again
            items = list(self._open.items())
            args: list[str] = []
            for k, u in items:
                args += [k, u.to_json()]
            await self._reopen(keys=[self._key("open", self.replica), *(self._key("closed", k) for k, _ in items)],
                               args=args)

    async def finalise_dead(self) -> int:
        """Finalise the open records of every replica whose liveness lapsed; forget replicas left with none."""
        n = 0
        for raw in await self.redis.smembers(self._replicas):
            other = raw.decode() if isinstance(raw, bytes) else raw
            if other == self.replica or await self.redis.exists(self._key("live", other)):
                continue
            hkey = self._key("open", other)
            for f in await self.redis.hkeys(hkey):
                uid = f.decode() if isinstance(f, bytes) else f
                v = await self._claim(keys=[hkey, self._key("closed", uid)], args=[uid, TOMBSTONE_S])
                if v:
                    u = OpenUsage.from_json(v)
                    self._write(u.finalised_record(self.replica), u)
                    n += 1
            if not await self.redis.hlen(hkey):
                await self.redis.srem(self._replicas, other)
        if n:
            self.finalised += n
            log.warning("finalised %d usage record(s) left open by dead gateway replicas", n)
        return n
