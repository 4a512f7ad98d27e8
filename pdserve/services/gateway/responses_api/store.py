"""Stored responses, for `previous_response_id`: tenant-scoped, expiring, bounded (Redis).

A response is stored as the conversation it ends (its input items, those of the response it continued, and its
output items) under its tenant's name, for `TTL_S`; a request that names it as `previous_response_id` gets those
items before its own input (`instructions` are not carried over, as OpenAI does not carry them). Only the
tenant that made a response can continue it: another tenant's id is not found. Bounded: a conversation over
`MAX_BYTES` is not stored, a tenant keeps at most `MAX_PER_TENANT` responses (the oldest go first). Without
Redis nothing is stored; a Redis error while storing leaves the answer unstored (it says `store: false`), while
reading is a 503 (the conversation is there, the store is not).
"""
from __future__ import annotations

import json
import logging
import re
import time

from redis.exceptions import RedisError

from pdserve.services.gateway.params import APIError, bad

log = logging.getLogger("pdserve.gateway")

TTL_S = 3600
MAX_BYTES = 1 << 20
MAX_PER_TENANT = 1000
_ID = re.compile(r"^resp_[0-9a-f]{24}$")  # the ids this gateway gives (output.response_id): nothing else is a key


class ResponseStore:
    def __init__(self, redis, model: str):
        self.r = redis  # redis.asyncio client (its socket timeout bounds every call)
        self.prefix = f"pdserve:{model}:responses"

    # entries and indexes under different words: no tenant name (the operator's, free text) makes one the other
    def _key(self, tenant: str, rid: str) -> str:
        return f"{self.prefix}:entry:{tenant}:{rid}"

    def _index(self, tenant: str) -> str:
        return f"{self.prefix}:index:{tenant}"

    async def save(self, tenant: str, rid: str, items: list[dict]) -> bool:
        """Store the conversation `rid` ends; False when it was not (too big, or Redis failed)."""
        blob = json.dumps(items, ensure_ascii=False)
        if len(blob.encode()) > MAX_BYTES:
            return False
        index, now = self._index(tenant), time.time()
        try:
            async with self.r.pipeline(transaction=True) as p:
                p.set(self._key(tenant, rid), blob, ex=TTL_S)
                p.zadd(index, {rid: now})
                p.zremrangebyscore(index, 0, now - TTL_S)  # expired entries leave the index too
                p.zrange(index, 0, -(MAX_PER_TENANT + 1))  # the oldest, beyond the cap
                p.expire(index, TTL_S)
                over = (await p.execute())[3]
            if over:
                over = [x.decode() if isinstance(x, bytes) else x for x in over]
                async with self.r.pipeline(transaction=True) as p:
                    p.delete(*[self._key(tenant, x) for x in over])
                    p.zrem(index, *over)
                    await p.execute()
        except (RedisError, OSError) as e:
            log.warning("response %s not stored: %s", rid, e)
            return False
        return True

    async def load(self, tenant: str, rid) -> list[dict]:
        """The conversation `rid` ended, for this tenant; a 400 naming previous_response_id when there is none."""
        if not isinstance(rid, str) or not _ID.match(rid):
            raise bad("previous_response_id", "is not a response id of this server (resp_ and 24 hex digits)")
        try:
            blob = await self.r.get(self._key(tenant, rid))
        except (RedisError, OSError):
            raise APIError(503, "the response store is unavailable; retry, or send the whole conversation as input",
                           "service_unavailable_error", "previous_response_id", "store_unavailable") from None
        if blob is None:
            raise bad("previous_response_id", f"no stored response {rid} (responses are kept {TTL_S} s, for the "
                                              "API key that made them)")
        return json.loads(blob)
