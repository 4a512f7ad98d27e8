"""Redis worker registry.

Key `pdserve:{model}:workers:{id}` is a hash (role, address, agent_name, capacity_blocks, layout, load,
updated) whose TTL is refreshed by every heartbeat: a worker that stops heartbeating disappears by itself, so a
lapsed worker can never be routed to. `pdserve:{model}:worker_ids` is a set indexing the hashes (stale members
are pruned on read). KV events (the prefix index) live in router/prefix_index.py's keys.

With an internal token configured (internal_security.py), each hash also carries `sig`, an HMAC-SHA256 over the
other fields keyed by a key derived from the token, and readers skip any record whose HMAC does not verify: a
process that can write to Redis but lacks the token cannot register a worker (and so receive prompts). `updated`
is signed too, so a replayed old record lapses like any other.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from dataclasses import asdict, dataclass, field

from pdserve.services.metrics import common as M
from pdserve.services.redis_conn import NO_AUTH, RedisAuth, connect

log = logging.getLogger("pdserve.registry")

DEFAULT_TTL_S = 3.0
SIG_FIELD = "sig"


def workers_key(model: str, worker_id: str) -> str:
    return f"pdserve:{model}:workers:{worker_id}"


def index_key(model: str) -> str:
    return f"pdserve:{model}:worker_ids"


@dataclass
class WorkerRecord:
    worker_id: str
    role: str  # prefill | decode | both
    address: str
    agent_name: str = ""
    capacity_blocks: int = 0
    layout: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)
    updated: float = 0.0

    def to_hash(self) -> dict[str, str]:
        d = asdict(self)
        d["layout"] = json.dumps(self.layout)
        d["load"] = json.dumps(self.load)
        return {k: str(v) for k, v in d.items()}

    @classmethod
    def from_hash(cls, h: dict) -> "WorkerRecord":
        h = _decoded(h)
        return cls(worker_id=h["worker_id"], role=h["role"], address=h["address"],
                   agent_name=h.get("agent_name", ""), capacity_blocks=int(h.get("capacity_blocks", 0) or 0),
                   layout=json.loads(h.get("layout") or "{}"), load=json.loads(h.get("load") or "{}"),
                   updated=float(h.get("updated", 0) or 0))


def _decoded(h: dict) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in h.items()}


def record_sig(key: bytes, model: str, fields: dict[str, str]) -> str:
    """HMAC over the model and every field but the signature itself, in a canonical (sorted JSON) form."""
    body = json.dumps([model, sorted((k, v) for k, v in fields.items() if k != SIG_FIELD)], separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


class Registry:
    def __init__(self, redis_url: str, model: str, ttl_s: float = DEFAULT_TTL_S, auth: RedisAuth = NO_AUTH,
                 key: bytes | None = None):
        """`key`: the registry HMAC key (InternalSecurity.registry_key()); None: records are neither signed nor
        checked."""
        self.model = model
        self.ttl_s = ttl_s
        self.key = key
        self.r = connect(redis_url, auth)
        self._refused: set[str] = set()  # worker ids already logged as forged (log once, count every time)

    def _authentic(self, worker_id: str, h: dict[str, str]) -> bool:
        if self.key is None:
            return True
        sig = h.get(SIG_FIELD, "")
        # the key name is not signed: a signed record copied under another worker's key is refused too
        if h.get("worker_id") == worker_id and \
                hmac.compare_digest(sig.encode(), record_sig(self.key, self.model, h).encode()):
            return True
        M.REGISTRY_REJECTED.inc()
        if worker_id not in self._refused:
            self._refused.add(worker_id)
            log.warning("ignoring registry record %r: its HMAC does not verify (written without the internal token)",
                        worker_id)
        return False

    async def heartbeat(self, rec: WorkerRecord) -> None:
        """Register or refresh (same write: a worker that lapsed re-registers with its next heartbeat)."""
        rec.updated = time.time()
        key = workers_key(self.model, rec.worker_id)
        fields = rec.to_hash()
        if self.key is not None:
            fields[SIG_FIELD] = record_sig(self.key, self.model, fields)
        async with self.r.pipeline(transaction=True) as p:
            p.delete(key)  # no field of an earlier (or forged) record survives next to the signed ones
            p.hset(key, mapping=fields)
            p.pexpire(key, int(self.ttl_s * 1000))
            p.sadd(index_key(self.model), rec.worker_id)
            await p.execute()

    async def deregister(self, worker_id: str) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.delete(workers_key(self.model, worker_id))
            p.srem(index_key(self.model), worker_id)
            await p.execute()

    async def live_workers(self) -> list[WorkerRecord]:
        ids = sorted(m.decode() for m in await self.r.smembers(index_key(self.model)))
        if not ids:
            return []
        async with self.r.pipeline(transaction=False) as p:
            for i in ids:
                p.hgetall(workers_key(self.model, i))
            hashes = await p.execute()
        out, stale = [], []
        now = time.time()
        for i, h in zip(ids, hashes):
            if not h:
                stale.append(i)  # hash expired: heartbeat lapsed
                continue
            h = _decoded(h)
            if not self._authentic(i, h):
                continue
            rec = WorkerRecord.from_hash(h)
            if now - rec.updated > self.ttl_s:  # belt and braces if a TTL refresh raced
                continue
            out.append(rec)
        if stale:
            await self.r.srem(index_key(self.model), *stale)
        return out

    async def close(self) -> None:
        await self.r.aclose()
