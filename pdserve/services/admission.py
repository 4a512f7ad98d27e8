"""Scheduler admission (spec §1.2 stage two, §5.5, Q13): after tokenize, reserve KV for prompt + predicted output.

A reservation is bookkeeping, not memory: `pdserve:{model}:reservations` (sorted set: request id -> lease expiry
in ms) and `pdserve:{model}:reservation_blocks` (hash: request id -> blocks). One Lua script prunes expired
leases, then admits the request if the reserved blocks + its own fit the capacity and the reserved requests + 1
fit the sequence slots, all atomically, so every gateway replica sees one ledger. A gateway renews the leases of
its live requests every `lease_s / 3`; a crashed gateway stops renewing and its reservations expire by
themselves. Physical blocks are still taken only when an engine tick selects the request.

Capacity = sum over serving workers (decode, or both) of KV blocks x `overcommit`; sequence slots = sum of
their `max_num_seqs`; read from the worker registry in Redis.

Output length prediction: `min(max_tokens, max(min_predict, p90 of this tenant's last 256 observed outputs))`
once 20 outputs were seen, else `max_tokens` (or the context left when it is unset). Underprediction is not
fatal: the engine preempts when blocks really run out.
KV of a request: prompt blocks once (the prefix cache shares them between the n branches, Q24) + n x output.

Outcomes: REJECTED 400 (the prompt can never fit a worker), DEGRADED (n lowered until it fits; the client is
told), QUEUED (waits for capacity up to its queue deadline: bounded queue per replica), REJECTED 503 with
Retry-After (queue full), TIMED_OUT (queue deadline passed).

Redis down: a process-local ledger with the same rules takes over (each replica then admits up to the whole
capacity: degraded, counted in `pdserve_admission_degraded_total`); live reservations are written back to
Redis by the renew loop when it returns, so the ledger recovers after a Redis restart.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.services import metrics as M

log = logging.getLogger("pdserve.admission")

# KEYS: zset, hash. ARGV: rid, blocks, cap_blocks, cap_seqs, lease_ms. Returns {ok, used_blocks, used_seqs}.
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
local blocks = tonumber(ARGV[2])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[5]), ARGV[1])
  return {1, used, seqs}
end
if used + blocks > tonumber(ARGV[3]) or seqs + 1 > tonumber(ARGV[4]) then
  return {0, used, seqs}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[5]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], blocks)
return {1, used + blocks, seqs + 1}
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


class AdmissionError(Exception):
    def __init__(self, status: int, message: str, code: str, state: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.state, self.retry_after_s = (
            status, message, code, state, retry_after_s)


@dataclass
class Capacity:
    blocks: int
    seqs: int
    block_size: int
    max_worker_blocks: int  # the largest single worker: a prompt needing more can never run


class OutputPredictor:
    """Per-tenant running p90 of observed output lengths (this replica's observations)."""

    def __init__(self, window: int = 256, min_samples: int = 20, min_predict: int = 16):
        self.window, self.min_samples, self.min_predict = window, min_samples, min_predict
        self._obs: dict[str, deque[int]] = {}

    def observe(self, tenant: str, n_out: int) -> None:
        self._obs.setdefault(tenant, deque(maxlen=self.window)).append(int(n_out))

    def p90(self, tenant: str) -> int | None:
        obs = self._obs.get(tenant)
        if not obs or len(obs) < self.min_samples:
            return None
        s = sorted(obs)
        return s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]

    def predict(self, tenant: str, max_tokens: int | None, context_left: int) -> int:
        cap = min(max_tokens, context_left) if max_tokens is not None else context_left
        p = self.p90(tenant)
        if p is None:
            return max(1, cap)
        return max(1, min(cap, max(self.min_predict, p)))


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

    def reserve(self, rid: str, blocks: int, cap: Capacity, lease_s: float) -> bool:
        self._prune()
        if rid in self.entries:
            self.entries[rid] = (self.entries[rid][0], self.clock() + lease_s)
            return True
        used = sum(b for b, _ in self.entries.values())
        if not fits(used, len(self.entries), blocks, cap):
            return False
        self.entries[rid] = (blocks, self.clock() + lease_s)
        return True

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

    async def reserve(self, rid: str, blocks: int, cap: Capacity) -> bool:
        if self.redis is not None:
            try:
                ok, _, _ = await self._reserve(keys=[self.zkey, self.hkey],
                                               args=[rid, blocks, cap.blocks, cap.seqs, int(self.lease_s * 1000)])
                return bool(ok)
            except Exception as e:  # noqa: BLE001
                self._degraded("reserve", e)
        return self.local.reserve(rid, blocks, cap, self.lease_s)

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


@dataclass
class Ticket:
    rid: str
    blocks: int
    n_granted: int
    n_requested: int
    predicted_output: int
    queued_s: float = 0.0
    states: list[str] = field(default_factory=list)  # admission trail: QUEUED / DEGRADED

    @property
    def degraded(self) -> bool:
        return self.n_granted < self.n_requested


def blocks_for(prompt_tokens: int, output_tokens: int, n: int, block_size: int, cached_tokens: int = 0) -> int:
    """Prompt blocks once (shared by n branches through the prefix cache), plus n x the output's blocks.
    Blocks already cached on the worker (`cached_tokens`) need no new memory."""
    prompt = max(0, math.ceil(prompt_tokens / block_size) - cached_tokens // block_size)
    return prompt + n * math.ceil(output_tokens / block_size)


# ---- the decision, pure (no I/O, no clock, no metrics) ----------------------------------------------------------
# `Admission.admit` below and the simulator (`pdserve.sim.admission`) both decide through these functions, so the
# simulated gateway admits, degrades, queues and rejects as the real one does for the same capacity.
def fits(used_blocks: int, used_seqs: int, blocks: int, cap: Capacity) -> bool:
    """The ledger's rule (RESERVE_LUA makes the same comparison inside Redis)."""
    return used_blocks + blocks <= cap.blocks and used_seqs + 1 <= cap.seqs


def options(prompt_tokens: int, pred: int, n: int, block_size: int, cached_tokens: int = 0,
            allow_degrade: bool = True) -> list[tuple[int, int]]:
    """(copies granted, blocks to reserve) in the order to try: n, then n-1 .. 1 when degrading is allowed."""
    return [(k, blocks_for(prompt_tokens, pred, k, block_size, cached_tokens))
            for k in range(n, 0 if allow_degrade else n - 1, -1)]


def prepare(predictor: OutputPredictor, tenant: str, prompt_tokens: int, max_tokens: int | None, n: int,
            context_len: int, cap: Capacity | None, cached_tokens: int = 0,
            allow_degrade: bool = True) -> tuple[int, list[tuple[int, int]]]:
    """The checks that need no ledger, then what to try reserving: (predicted output, options). Raises REJECTED
    503 (no serving workers) or 400 (the prompt can never fit one worker)."""
    if cap is None:
        raise AdmissionError(503, "no serving workers", "no_workers", "REJECTED", 1.0)
    bs = cap.block_size
    if math.ceil((prompt_tokens + 1) / bs) > cap.max_worker_blocks:
        raise AdmissionError(400, f"prompt of {prompt_tokens} tokens can never fit a worker's KV cache "
                                  f"({cap.max_worker_blocks} blocks of {bs} tokens)", "context_length_exceeded",
                             "REJECTED")
    pred = predictor.predict(tenant, max_tokens, context_len - prompt_tokens)
    # never reserve more than one worker can hold: the request would wait forever
    pred = min(pred, cap.max_worker_blocks * bs - prompt_tokens)
    return pred, options(prompt_tokens, pred, n, bs, cached_tokens, allow_degrade)


def make_ticket(rid: str, k: int, n: int, blocks: int, pred: int) -> Ticket:
    t = Ticket(rid, blocks, k, n, pred)
    if k < n:
        t.states.append("DEGRADED")
    return t


def no_fit(queued: int, max_queue: int, deadline: float, now: float, max_queue_wait_s: float) -> float:
    """Nothing fits now: the time to wait until (QUEUED), or REJECTED 503 when this replica's queue is full
    (bounded, so overload is told at once instead of piling up behind a queue that cannot drain)."""
    if queued >= max_queue:
        raise AdmissionError(503, "server at capacity; retry later", "capacity", "REJECTED", 1.0)
    return min(deadline, now + max_queue_wait_s)


class Admission:
    def __init__(self, ledger: ReservationLedger, capacity_fn, max_queue: int = 16, max_queue_wait_s: float = 10.0,
                 poll_s: float = 0.02):
        self.ledger = ledger
        self.capacity_fn = capacity_fn  # async () -> Capacity | None
        self.predictor = OutputPredictor()
        self.max_queue = max_queue
        self.max_queue_wait_s = max_queue_wait_s
        self.poll_s = poll_s
        self.held: dict[str, int] = {}  # this replica's live reservations (renewed)
        # backstop: a request whose terminal path never ran (a bug, a response never started) stops being renewed
        # `orphan_grace_s` after its deadline, so its reservation expires like a crashed gateway's
        self.held_until: dict[str, float] = {}
        self.orphan_grace_s = 30.0
        self.queued = 0
        self.degraded_live = 0
        self._released = asyncio.Event()
        self._renewer: asyncio.Task | None = None

    def start(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def stop(self) -> None:
        if self._renewer:
            self._renewer.cancel()
            with contextlib.suppress(BaseException):
                await self._renewer
        for rid in list(self.held):
            await self.release(rid)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ledger.lease_s / 3)
            now = time.time()
            for rid in [r for r, t in self.held_until.items() if t < now]:
                log.warning("admission: reservation %s outlived its deadline; dropped", rid)
                await self.release(rid)
            with contextlib.suppress(Exception):
                await self.ledger.renew(dict(self.held))
                blocks, reqs = await self.ledger.usage()
                M.RESERVED_BLOCKS.set(blocks)
                M.RESERVED_REQUESTS.set(reqs)

    async def admit(self, rid: str, tenant: str, prompt_tokens: int, max_tokens: int | None, n: int,
                    context_len: int, deadline: float, cached_tokens: int = 0,
                    allow_degrade: bool = True) -> Ticket:
        cap = await self.capacity_fn()
        pred, first = prepare(self.predictor, tenant, prompt_tokens, max_tokens, n, context_len, cap,
                              cached_tokens, allow_degrade)
        t0 = time.monotonic()
        ticket = await self._try(rid, n, pred, first, cap)
        if ticket is not None:
            self.held_until[rid] = deadline + self.orphan_grace_s
            return ticket
        try:
            queue_deadline = no_fit(self.queued, self.max_queue, deadline, time.time(), self.max_queue_wait_s)
        except AdmissionError:
            M.REJECTIONS.labels("capacity").inc()
            raise
        self.queued += 1
        M.STATE_GAUGE.labels("QUEUED").inc()
        try:
            while time.time() < queue_deadline:
                self._released.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._released.wait(), timeout=self.poll_s * 5)
                cap = await self.capacity_fn() or cap  # the pool may have changed while waiting
                ticket = await self._try(rid, n, pred, options(prompt_tokens, pred, n, cap.block_size,
                                                               cached_tokens, allow_degrade), cap)
                if ticket is not None:
                    self.held_until[rid] = deadline + self.orphan_grace_s
                    ticket.queued_s = time.monotonic() - t0
                    ticket.states.insert(0, "QUEUED")
                    return ticket
        finally:
            self.queued -= 1
            M.STATE_GAUGE.labels("QUEUED").dec()
        raise AdmissionError(504, f"request timed out after {time.monotonic() - t0:.2f} s waiting for capacity",
                             "timeout", "TIMED_OUT")

    async def _try(self, rid: str, n: int, pred: int, opts: list[tuple[int, int]], cap: Capacity) -> Ticket | None:
        for k, blocks in opts:
            if await self.ledger.reserve(rid, blocks, cap):
                self.held[rid] = blocks
                return make_ticket(rid, k, n, blocks, pred)
        return None

    async def release(self, rid: str) -> None:
        """Idempotent: the reservation goes back whichever terminal path runs first."""
        self.held_until.pop(rid, None)
        if self.held.pop(rid, None) is None:
            return
        await self.ledger.release(rid)
        self._released.set()


def capacity_from_workers(records, overcommit: float = 1.0, default_seqs: int = 64) -> Capacity | None:
    """Capacity of the serving pool: decode workers (they hold KV for the whole request) or `both` workers."""
    serving = [r for r in records if r.role == "decode"] or [r for r in records if r.role == "both"]
    if not serving:
        return None
    bs = int((serving[0].layout or {}).get("block_size", 16) or 16)
    blocks = [int((r.load or {}).get("kv_blocks_total") or r.capacity_blocks or 0) for r in serving]
    seqs = sum(int((r.load or {}).get("max_num_seqs") or default_seqs) for r in serving)
    return Capacity(int(sum(blocks) * overcommit), seqs, bs, max(blocks))


class RegistryCapacity:
    """Capacity read from the worker registry, cached for `ttl_s` (workers heartbeat about once a second)."""

    def __init__(self, registry, overcommit: float = 1.0, ttl_s: float = 1.0):
        self.registry, self.overcommit, self.ttl_s = registry, overcommit, ttl_s
        self._cap: Capacity | None = None
        self._at = 0.0

    async def __call__(self) -> Capacity | None:
        if time.monotonic() - self._at > self.ttl_s or self._cap is None:
            try:
                self._cap = capacity_from_workers(await self.registry.live_workers(), self.overcommit)
                self._at = time.monotonic()
            except Exception as e:  # noqa: BLE001 - keep the last known capacity while Redis is away
                log.warning("admission: capacity not refreshed (%s)", e)
        return self._cap


# ---- request lifecycle metadata between gateway and workers (gRPC metadata: no proto change needed) ----------
MD_DEADLINE, MD_PRIORITY, MD_PREDICTED = "x-pdserve-deadline", "x-pdserve-priority", "x-pdserve-predicted-output"


def lifecycle_metadata(deadline: float | None, priority: int | None, predicted: int | None) -> tuple:
    md = []
    if deadline is not None:
        md.append((MD_DEADLINE, f"{deadline:.6f}"))
    if priority is not None:
        md.append((MD_PRIORITY, str(int(priority))))
    if predicted is not None:
        md.append((MD_PREDICTED, str(int(predicted))))
    return tuple(md)


def lifecycle_from_context(context) -> dict:
    """Worker side: deadline / priority / predicted output from the call's metadata (absent -> engine defaults)."""
    out: dict = {}
    try:
        md = dict(context.invocation_metadata() or ())
    except Exception:  # noqa: BLE001
        return out
    with contextlib.suppress(ValueError, TypeError):
        if MD_DEADLINE in md:
            out["deadline"] = float(md[MD_DEADLINE])
        if MD_PRIORITY in md:
            out["priority"] = int(md[MD_PRIORITY])
        if MD_PREDICTED in md:
            out["predicted_output_tokens"] = int(md[MD_PREDICTED])
    return out
