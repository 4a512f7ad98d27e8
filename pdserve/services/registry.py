"""Redis worker registry.

Key `pdserve:{model}:workers:{id}` is a hash (`info`: a serialized WorkerInfo, `load`: a serialized LoadReport,
`updated`: unix time) whose TTL is refreshed by every heartbeat: a worker that stops heartbeating disappears by itself, so a
lapsed worker can never be routed to. `pdserve:{model}:worker_ids` is a set indexing the hashes (stale members
are pruned on read). KV events (the prefix index) live in router/prefix_index.py's keys.

With an internal token configured (internal_security.py), each hash also carries `sig`, an HMAC-SHA256 over the
model and the other stored fields (the serialized WorkerInfo and LoadReport as stored, `updated`) keyed by a key
derived from the token, and readers skip any record whose HMAC does not verify: a
process that can write to Redis but lacks the token cannot register a worker (and so receive prompts). `updated`
is signed too, so a replayed old record lapses like any other; the WorkerInfo's worker id must match the key's.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field

from pdserve.services.metrics import common as M
from pdserve.services.pb import common_pb2
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
    """A live worker as the registry holds it; `load` is its last LoadReport (wire forms: record_to_pb / _hash)."""

    worker_id: str
    role: str  # prefill | decode | both
    address: str
    agent_name: str = ""
    capacity_blocks: int = 0
    layout: common_pb2.KvLayout = field(default_factory=common_pb2.KvLayout)
    load: common_pb2.LoadReport = field(default_factory=common_pb2.LoadReport)
    updated: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)  # `--labels`: zone, node, price (router/spread.py)
    kv_transport: str = ""  # kv_transfer/transport.py, for `pdserve status`
    # a decode worker's prefill peers -> the UCX transport that carried their READs (kv_transfer/ucx_proto_info.py)
    kv_transport_observed: dict[str, str] = field(default_factory=dict)
    role_switch: str = ""  # "prefill->decode" while switching (role is then `switching`: services/role_switch.py)


# ---- wire forms (the registry's hash, the router's WorkerInfo) -------------------------------------------------------
def record_to_pb(r: WorkerRecord) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(worker_id=r.worker_id, role=r.role, address=r.address, agent_name=r.agent_name,
                                 capacity_blocks=r.capacity_blocks, layout=r.layout, labels=r.labels,
                                 kv_transport=r.kv_transport, role_switch=r.role_switch,
                                 kv_transport_observed=r.kv_transport_observed)


def record_from_pb(w: common_pb2.WorkerInfo, load: common_pb2.LoadReport | None = None) -> WorkerRecord:
    return WorkerRecord(w.worker_id, w.role, w.address, w.agent_name, w.capacity_blocks, _copy(w.layout),
                        _copy(load) if load is not None else common_pb2.LoadReport(), labels=dict(w.labels),
                        kv_transport=w.kv_transport, role_switch=w.role_switch,
                        kv_transport_observed=dict(w.kv_transport_observed))


def _copy(m):
    out = type(m)()
    out.CopyFrom(m)
    return out


def record_to_hash(rec: WorkerRecord) -> dict[str, bytes]:
    """The registry's Redis hash: serialized protos plus the heartbeat time (the TTL check reads it)."""
    return {"info": record_to_pb(rec).SerializeToString(), "load": rec.load.SerializeToString(),
            "updated": repr(float(rec.updated)).encode()}


def record_from_hash(h: dict) -> WorkerRecord:
    h = {(k.decode() if isinstance(k, bytes) else k): v for k, v in h.items()}
    rec = record_from_pb(common_pb2.WorkerInfo.FromString(h["info"]), common_pb2.LoadReport.FromString(h["load"]))
    rec.updated = float(h["updated"])
    return rec


def record_sig(key: bytes, model: str, fields: dict[str, bytes]) -> str:
    """HMAC over the model and every stored field but the signature itself (the serialized WorkerInfo and
    LoadReport, `updated`), in a canonical form: JSON of [model, sorted [name, hex(value)] pairs]."""
    pairs = sorted((k, (v if isinstance(v, bytes) else str(v).encode()).hex())
                   for k, v in fields.items() if k != SIG_FIELD)
    body = json.dumps([model, pairs], separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


class Registry:
    def __init__(self, redis_url: str, model: str, ttl_s: float = DEFAULT_TTL_S, auth: RedisAuth = NO_AUTH,
                 key: bytes | None = None):
        """`key`: the registry HMAC key (InternalSecurity.registry_key()); None: records are neither signed nor
        checked."""
        self.model = model
        self.ttl_s = ttl_s
        self.key = key
        # Every call bounded, so that a connection gone silent (a replaced Redis pod: no reset, no answer) is given
        # up and a new one opened before this worker's entry lapses: a heartbeat hung for a quarter TTL and retried
        # soon after (worker.py) still lands inside the TTL. (redis-py's own default has been None or 5 s
        # depending on its version.) The router's blocking stream reads wait 50 ms, well inside.
        self.call_timeout_s = max(0.5, ttl_s / 4)
        self.r = connect(redis_url, auth, socket_timeout=self.call_timeout_s,
                         socket_connect_timeout=self.call_timeout_s)
        self._refused: set[str] = set()  # worker ids already logged as forged (log once, count every time)

    def _authentic(self, worker_id: str, h: dict[str, bytes]) -> bool:
        if self.key is None:
            return True
        sig = h.get(SIG_FIELD, b"")
        if hmac.compare_digest(sig, record_sig(self.key, self.model, h).encode()):
            return True
        self._refuse(worker_id, "its HMAC does not verify (written without the internal token)")
        return False

    def _refuse(self, worker_id: str, why: str) -> None:
        M.REGISTRY_REJECTED.inc()
        if worker_id not in self._refused:
            self._refused.add(worker_id)
            log.warning("ignoring registry record %r: %s", worker_id, why)

    async def heartbeat(self, rec: WorkerRecord) -> None:
        """Register or refresh (same write: a worker that lapsed re-registers with its next heartbeat)."""
        rec.updated = time.time()
        key = workers_key(self.model, rec.worker_id)
        fields = record_to_hash(rec)
        if self.key is not None:
            fields[SIG_FIELD] = record_sig(self.key, self.model, fields).encode()
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
            h = {(k.decode() if isinstance(k, bytes) else k): v for k, v in h.items()}
            if not self._authentic(i, h):
                continue
            try:
                rec = record_from_hash(h)
            except Exception as e:  # noqa: BLE001 - a malformed record is skipped like a forged one
                self._refuse(i, f"it does not parse ({e!r})")
                continue
            if self.key is not None and rec.worker_id != i:
                # the key name is not signed: a signed record copied under another worker's key is refused too
                self._refuse(i, f"it names worker {rec.worker_id!r}")
                continue
            if now - rec.updated > self.ttl_s:  # belt and braces if a TTL refresh raced
                continue
            out.append(rec)
        if stale:
            await self.r.srem(index_key(self.model), *stale)
        return out

    async def close(self) -> None:
        await self.r.aclose()

