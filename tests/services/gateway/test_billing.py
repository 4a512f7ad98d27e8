"""The gateway's billing record (services/gateway/billing.py): the tokens a record says were billed are the tokens
charged to the tenant's quota, whichever way the request ended. Real Redis (quota windows, reservations)."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid

import pytest
import redis.asyncio as aioredis

from pdserve.services.admission import Admission, AdmissionError, Capacity
from pdserve.services.gateway.ingress import IngressGate
from pdserve.services.gateway.lifecycle import RequestLifecycle
from pdserve.services.gateway.params import APIError
from pdserve.services.gateway.stages import StageTrace, kv_moved
from pdserve.services.gateway.tenants import TenantDirectory
from pdserve.services.pb import common_pb2
from pdserve.services.reservations import ReservationLedger
from tests.services._redis import REDIS, cleanup, redis_up

pytestmark = pytest.mark.skipif(not redis_up(), reason="needs Redis on 127.0.0.1:6379")


def _lifecycle(tmp_path, r, model: str) -> RequestLifecycle:
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants:\n  slowco: {keys: [sk-slow], quota_tokens: 100, quota_window_s: 60}\n")
    cap = Capacity(blocks=64, seqs=8, block_size=16, max_worker_blocks=8)  # a prompt over 127 tokens never fits

    async def capacity():
        return cap

    adm = Admission(ReservationLedger(r, model, lease_s=5), capacity, max_queue=4, max_queue_wait_s=5)
    return RequestLifecycle(IngressGate(TenantDirectory(str(keys)), r, model), adm, model)


def _records(caplog) -> list[dict]:
    return [json.loads(x.getMessage()) for x in caplog.records if x.name == "pdserve.billing"]


def test_rejected_after_tokenizing_bills_and_charges_nothing(tmp_path, caplog):
    """A request admission refuses (400: its prompt fits no worker) knows its prompt length, but ran nothing: the
    record must say 0 billed, as the quota was charged 0 (the record said prompt_tokens billed)."""
    model = f"t-{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.INFO, logger="pdserve.billing")

    async def main():
        r = aioredis.from_url(REDIS)
        life = _lifecycle(tmp_path, r, model)
        rec = life.new_record()
        await life.authorize(rec, {"authorization": "Bearer sk-slow"})
        life.deadline_for(None, rec)
        with pytest.raises(AdmissionError) as e:
            await life.admit(rec, "req-big", [list(range(150))], 16, 1, 4096)
        assert e.value.status == 400
        await life.finish(rec, "REJECTED", str(e.value))
        await life.gate.check_limits(rec.tenant)  # nothing charged: 150 tokens would exceed the 100-token quota
        # a finished request of the same prompt is billed prompt + committed, and charged exactly that
        done = life.new_record()
        await life.authorize(done, {"authorization": "Bearer sk-slow"})
        await life.admit(done, "req-ok", [list(range(90))], 16, 1, 4096)
        done.generated = done.emitted = done.committed = 12
        done.traces = [_trace("disagg", 100.0, 100.25, 3 << 20), _trace("colocated"),
                       _trace("disagg", 101.0, 101.5, 1 << 20)]  # n=3 sub-requests: two pulled, one prefilled locally
        await life.finish(done, "FINISHED")
        with pytest.raises(APIError) as q:
            await life.gate.check_limits(done.tenant)  # 102 > 100
        assert q.value.code == "quota_exceeded"
        await life.close()
        await cleanup(r, model)

    asyncio.run(main())
    rejected, finished = _records(caplog)
    assert (rejected["state"], rejected["prompt_tokens"], rejected["billed_tokens"]) == ("REJECTED", 150, 0)
    assert rejected["times"]["arrival"] <= rejected["times"]["finished"] and rejected["admission"] == []
    assert (finished["state"], finished["billed_tokens"], finished["committed_tokens"]) == ("FINISHED", 102, 12)
    assert finished["n_granted"] == 1 and finished["reserved_blocks"] >= 7 and finished["finalised_by"] is None
    assert (finished["kv_bytes"], finished["kv_transfer_s"]) == (4 << 20, 0.75)
    assert (rejected["kv_bytes"], rejected["kv_transfer_s"]) == (0, 0.0)


def _trace(mode: str, start: float = 0.0, end: float = 0.0, nbytes: int = 0) -> StageTrace:
    """A sub-request's trace as the dispatcher fills it: routed, then the decode worker's first message."""
    t = StageTrace()
    t.on_route(mode)
    t.on_stream(common_pb2.StageTimes(arrival=start, kv_transfer_start=start, kv_transfer_end=end, kv_bytes=nbytes))
    return t


def test_the_kv_moved_is_the_pulls_of_the_disaggregated_sub_requests():
    assert kv_moved([_trace("colocated")]) is None and kv_moved([]) is None
    kv = kv_moved([_trace("disagg", 10.0, 10.002, 65536), _trace("colocated")])
    assert kv.usage() == {"bytes": 65536, "seconds": 0.002, "pulls": 1}
    assert kv.headers() == {"x-pdserve-kv-bytes": "65536", "x-pdserve-kv-transfer-ms": "2.000"}
