"""Ingress gate (spec §1.2 stage one): cheap checks before the body is parsed or tokenized.

Order: body size (413) -> API key -> tenant (401) -> tenant quota (429) -> tenant token bucket (429), both with
`Retry-After`. The bucket and the quota live in Redis and are checked by one Lua script (atomic, one round trip,
Redis' own clock), so every gateway replica draws from the same bucket and quota.

Redis down: the gate degrades instead of failing closed. Each replica falls back to an in-process bucket with the
tenant's full rate (so N replicas admit up to N x the rate while Redis is away) and skips the quota (usage is
not charged for that time); `pdserve_ingress_degraded_total` counts these decisions. Serving goes on.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from pdserve.services.gateway.params import APIError
from pdserve.services.gateway.tenants import Tenant, TenantDirectory
from pdserve.services.metrics import gateway as M

log = logging.getLogger("pdserve.gateway")

# KEYS[1] bucket hash, KEYS[2] quota counter; ARGV: rate/s, burst, cost, quota (0 = none), window seconds.
# Returns {allowed (1/0), retry_after_ms, reason}: reason 0 ok, 1 rate, 2 quota.
GATE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local quota, window = tonumber(ARGV[4]), tonumber(ARGV[5])
if quota > 0 then
  local used = tonumber(redis.call('GET', KEYS[2]) or '0')
  if used >= quota then
    local ttl = redis.call('PTTL', KEYS[2])
    if ttl < 0 then ttl = window * 1000 end
    return {0, ttl, 2}
  end
end
if rate <= 0 then return {1, 0, 0} end
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(b[1]), tonumber(b[2])
if tokens == nil then tokens = burst; ts = now end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate / 1000)
local allowed, wait = 0, 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
else
  wait = math.ceil((cost - tokens) * 1000 / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, wait, 1 - allowed}
"""

# KEYS[1] quota counter; ARGV: tokens, window seconds. The window starts at the first charge.
CHARGE_LUA = """
local v = redis.call('INCRBY', KEYS[1], ARGV[1])
if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000)) end
return v
"""


class LocalBucket:
    """The same token bucket in process memory: the fallback while Redis is unreachable."""

    def __init__(self):
        self._state: dict[str, tuple[float, float]] = {}

    def take(self, key: str, rate: float, burst: float, cost: float = 1.0) -> tuple[bool, float]:
        now = time.monotonic()
        tokens, ts = self._state.get(key, (burst, now))
        tokens = min(burst, tokens + (now - ts) * rate)
        if tokens >= cost:
            self._state[key] = (tokens - cost, now)
            return True, 0.0
        self._state[key] = (tokens, now)
        return False, (cost - tokens) / rate


@dataclass
class Admitted:
    tenant: Tenant
    body: bytes


def _closing(e: APIError) -> APIError:
    e.headers = {"Connection": "close"}
    return e


def retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


class IngressGate:
    def __init__(self, tenants: TenantDirectory, redis=None, model: str = "model", max_body_bytes: int = 1 << 20,
                 body_timeout_s: float = 30.0):
        self.tenants = tenants
        self.redis = redis  # redis.asyncio client or None (no shared limits: local buckets)
        self.model = model
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.local = LocalBucket()
        self._gate = redis.register_script(GATE_LUA) if redis is not None else None
        self._charge = redis.register_script(CHARGE_LUA) if redis is not None else None

    def bucket_key(self, tenant: str) -> str:
        return f"pdserve:{self.model}:ratelimit:{tenant}"

    def quota_key(self, tenant: str) -> str:
        return f"pdserve:{self.model}:quota:{tenant}"

    async def read_body(self, request) -> bytes:
        """413 before reading when Content-Length is too big; otherwise read at most the limit (chunked
        bodies are cut off there, so a huge upload cannot use up gateway memory). 408 when the whole body has not
        arrived within body_timeout_s: uvicorn has no read timeout, and a client trickling a byte now and then
        would hold the request (and its connection) for ever. Both leave unread bytes on the connection, so both
        close it."""
        limit = self.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and len(cl) < 20 and int(cl) > limit:
            raise _closing(APIError(413, f"request body of {cl} bytes exceeds the limit of {limit} bytes",
                                    code="request_too_large"))
        chunks, n = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    n += len(chunk)
                    if n > limit:
                        raise _closing(APIError(413, f"request body exceeds the limit of {limit} bytes",
                                                code="request_too_large"))
                    chunks.append(chunk)
        except TimeoutError:
            raise _closing(APIError(408, f"request body not received within {self.body_timeout_s:g} s",
                                    code="request_timeout")) from None
        return b"".join(chunks)

    @staticmethod
    def api_key(headers) -> str | None:
        auth = headers.get("authorization") or ""
        if auth.lower().startswith("bearer "):
            return auth[7:].strip() or None
        return headers.get("x-api-key") or None

    def authenticate(self, headers) -> Tenant:
        tenant = self.tenants.authenticate(self.api_key(headers))
        if tenant is None:
            raise APIError(401, "missing or invalid API key", "authentication_error", code="invalid_api_key")
        return tenant

    async def check_limits(self, tenant: Tenant, cost: float = 1.0) -> None:
        """Quota, then the rate bucket; raises 429 with Retry-After."""
        if tenant.rate_rps <= 0 and tenant.quota_tokens <= 0:
            return
        allowed, wait_s, reason = True, 0.0, 0
        if self._gate is not None:
            try:
                a, wait_ms, reason = await self._gate(
                    keys=[self.bucket_key(tenant.name), self.quota_key(tenant.name)],
                    args=[tenant.rate_rps, tenant.bucket_size, cost, tenant.quota_tokens, tenant.quota_window_s])
                allowed, wait_s = bool(a), int(wait_ms) / 1000.0
            except Exception as e:  # noqa: BLE001 - Redis away: degrade to a per-replica bucket
                M.INGRESS_DEGRADED.inc()
                log.warning("ingress: Redis unavailable (%s); per-replica rate limit", e)
                allowed, wait_s, reason = self._local(tenant, cost)
        else:
            allowed, wait_s, reason = self._local(tenant, cost)
        if not allowed:
            what = "token quota exhausted" if reason == 2 else "rate limit exceeded"
            code = "quota_exceeded" if reason == 2 else "rate_limit_exceeded"
            err = APIError(429, f"tenant {tenant.name}: {what}", "rate_limit_error", code=code)
            err.headers = {"Retry-After": retry_after(wait_s)}
            raise err

    def _local(self, tenant: Tenant, cost: float) -> tuple[bool, float, int]:
        if tenant.rate_rps <= 0:
            return True, 0.0, 0
        ok, wait = self.local.take(tenant.name, tenant.rate_rps, tenant.bucket_size, cost)
        return ok, wait, 0 if ok else 1

    async def charge(self, tenant: Tenant, tokens: int) -> None:
        """Add a finished request's tokens to its tenant's quota window (called once, by the billing owner)."""
        if tenant.quota_tokens <= 0 or tokens <= 0 or self._charge is None:
            return
        try:
            await self._charge(keys=[self.quota_key(tenant.name)], args=[int(tokens), tenant.quota_window_s])
        except Exception as e:  # noqa: BLE001
            M.INGRESS_DEGRADED.inc()
            log.warning("quota charge for %s lost (Redis: %s)", tenant.name, e)

    async def admit(self, request) -> Admitted:
        body = await self.read_body(request)
        tenant = self.authenticate(request.headers)
        await self.check_limits(tenant)
        return Admitted(tenant, body)
