"""Registry records signed with the internal token's key (real Redis): what a reader with the key accepts.

The forged records are written with plain redis commands, as a process holding Redis access but not the token would;
the expected signature in the tamper checks is computed here with hmac/hashlib from the documented canonical form,
not with the module's own function."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid

import pytest
import redis

from pdserve.services.internal_security import InternalSecurity
from pdserve.services.metrics import common as M
from pdserve.services.pb import common_pb2
from pdserve.services.registry import Registry, WorkerRecord, index_key, workers_key

REDIS = "redis://127.0.0.1:6379/0"
TOKEN = "a-test-token-with-enough-chars-0001"


@pytest.fixture()
def model():
    m = f"integrity-{uuid.uuid4().hex[:8]}"
    yield m
    r = redis.Redis.from_url(REDIS)
    for k in r.scan_iter(f"pdserve:{m}:*"):
        r.delete(k)


def _key(token: str) -> bytes:
    return hmac.new(token.encode(), b"pdserve registry record v1", hashlib.sha256).digest()


def _sig(key: bytes, model: str, fields: dict[str, bytes]) -> str:
    """The documented canonical form: JSON of [model, sorted [name, hex(value)] pairs], sig excluded."""
    body = json.dumps([model, sorted([k, v.hex()] for k, v in fields.items() if k != "sig")], separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def _renamed(fields: dict[str, bytes], worker_id: str, address: str | None = None) -> dict[str, bytes]:
    info = common_pb2.WorkerInfo.FromString(fields["info"])
    info.worker_id = worker_id
    if address is not None:
        info.address = address
    return {**fields, "info": info.SerializeToString()}


def _plant(model: str, worker_id: str, fields: dict[str, bytes]) -> None:
    r = redis.Redis.from_url(REDIS)
    r.delete(workers_key(model, worker_id))
    r.hset(workers_key(model, worker_id), mapping=fields)
    r.pexpire(workers_key(model, worker_id), 5000)
    r.sadd(index_key(model), worker_id)


def _ids(model: str, key: bytes | None) -> list[str]:
    async def main():
        reg = Registry(REDIS, model, key=key)
        try:
            return [w.worker_id for w in await reg.live_workers()]
        finally:
            await reg.close()
    return asyncio.run(main())


def test_registry_key_is_derived_not_the_token():
    assert InternalSecurity(token=TOKEN).registry_key() == _key(TOKEN)
    assert InternalSecurity().registry_key() is None


def test_signed_records_accepted_forged_and_tampered_skipped(model):
    key = _key(TOKEN)

    async def register():
        reg = Registry(REDIS, model, key=key)
        await reg.heartbeat(WorkerRecord("good", "decode", "10.0.0.1:7100", capacity_blocks=64))
        await reg.heartbeat(WorkerRecord("loadswap", "decode", "10.0.0.2:7100", capacity_blocks=64,
                                         load=common_pb2.LoadReport(num_running=9, kv_blocks_in_use=60)))
        await reg.close()
    asyncio.run(register())
    r = redis.Redis.from_url(REDIS)
    good = {k.decode(): v for k, v in r.hgetall(workers_key(model, "good")).items()}
    assert sorted(good) == ["info", "load", "sig", "updated"]  # serialized WorkerInfo + LoadReport + updated
    assert common_pb2.WorkerInfo.FromString(good["info"]).address == "10.0.0.1:7100"
    assert good["sig"].decode() == _sig(key, model, good)  # the documented canonical form

    now = str(time.time()).encode()
    _plant(model, "unsigned", {**_renamed(good, "unsigned", "6.6.6.6:1"), "updated": now, "sig": b""})
    # a valid signature lifted from a real record onto other fields
    _plant(model, "tampered", _renamed(good, "tampered", "6.6.6.6:1"))
    _plant(model, "good-copy", good)  # a genuine record, signature intact, copied under another worker's key
    wrong = _key("some-other-token-of-enough-length")
    fake = {**_renamed(good, "wrongkey", "6.6.6.6:1"), "updated": now}
    _plant(model, "wrongkey", {**fake, "sig": _sig(wrong, model, fake).encode()})
    # the load report is signed too: a genuine record with an idle-looking load swapped in
    busy = {k.decode(): v for k, v in r.hgetall(workers_key(model, "loadswap")).items()}
    _plant(model, "loadswap", {**busy, "load": common_pb2.LoadReport().SerializeToString()})

    before = M.REGISTRY_REJECTED._value.get()
    assert _ids(model, key) == ["good"]
    assert M.REGISTRY_REJECTED._value.get() - before == 5
    # the same Redis read without a key (no token configured): no check, every live record counts
    assert _ids(model, None) == ["good", "good", "loadswap", "tampered", "unsigned", "wrongkey"]


def test_reader_with_key_refuses_records_of_a_writer_without(model):
    async def register():
        reg = Registry(REDIS, model)  # a worker started without the token
        await reg.heartbeat(WorkerRecord("plain", "both", "127.0.0.1:9", capacity_blocks=8))
        await reg.close()
    asyncio.run(register())
    assert _ids(model, _key(TOKEN)) == []
    assert _ids(model, None) == ["plain"]
