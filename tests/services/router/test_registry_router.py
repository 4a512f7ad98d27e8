"""Registry on real Redis and the Router gRPC service: least-loaded placement, lapsed workers never routed."""
import asyncio
import uuid

import grpc
import pytest

from pdserve.services.grpc_util import channel
from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.registry import Registry, WorkerRecord
from pdserve.services.router.cache_aware import NoWorkers, Policy
from pdserve.services.router.server import RouterService
from tests.services._workers import drop_model_keys

REDIS = "redis://127.0.0.1:6379/0"


def rec(wid, role, running=0, **kw):
    # queued prefill work follows the running count (the cost model reads pending_prefill_tokens)
    return WorkerRecord(wid, role, f"127.0.0.1:{abs(hash(wid)) % 1000 + 20000}", load=common_pb2.LoadReport(
                        num_running=running, kv_blocks_total=100, pending_prefill_tokens=500 * running), **kw)


def test_policy_least_loaded_and_ties_random():
    pol = Policy("disagg")
    ws = [rec("p1", "prefill", 3), rec("p2", "prefill", 1), rec("d1", "decode", 0), rec("d2", "decode", 5)]
    p = pol.place(ws)
    assert p.mode == "disagg" and p.prefill.worker_id == "p2" and p.decode.worker_id == "d1"
    # placements since the last heartbeat count as load: a burst spreads over equal workers
    pol = Policy()
    eq = [rec("b1", "both"), rec("b2", "both")]
    picks = {pol.place(eq).both.worker_id for _ in range(2)}
    assert picks == {"b1", "b2"}
    with pytest.raises(NoWorkers):
        Policy().place([rec("p", "prefill")])
    assert Policy("disagg").place(ws, exclude={"d1"}).decode.worker_id == "d2"


def test_lapsed_heartbeat_never_routed():
    async def main():
        model = f"test-{uuid.uuid4().hex[:8]}"
        reg = Registry(REDIS, model, ttl_s=0.5)
        await reg.heartbeat(rec("alive", "both"))
        await reg.heartbeat(rec("dying", "both"))
        assert {w.worker_id for w in await reg.live_workers()} == {"alive", "dying"}
        for _ in range(4):  # only "alive" keeps heartbeating
            await asyncio.sleep(0.25)
            await reg.heartbeat(rec("alive", "both"))
        assert [w.worker_id for w in await reg.live_workers()] == ["alive"]

        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(RouterService(reg, view_ttl_s=0), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stub = router_pb2_grpc.RouterStub(channel(f"127.0.0.1:{port}"))
        for _ in range(10):
            r = await stub.Route(router_pb2.RouteRequest(request_id="x"))
            assert r.mode == "colocated" and r.both.worker_id == "alive"
        await reg.deregister("alive")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Route(router_pb2.RouteRequest(request_id="y"))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        await server.stop(0)
        await drop_model_keys(reg.r, model)
        await reg.close()

    asyncio.run(main())


def test_registry_survives_redis_restart(tmp_path):
    """Redis keeps nothing (--save ''): after a restart the next heartbeat re-registers the worker."""
    import subprocess
    import time

    from pdserve.services.ports import free_port

    port = free_port()

    def start():
        p = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                              "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
        for _ in range(100):
            try:
                import redis
                redis.Redis(port=port).ping()
                return p
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    async def main():
        p = start()
        reg = Registry(f"redis://127.0.0.1:{port}/0", "m", ttl_s=2)
        try:
            await reg.heartbeat(rec("w1", "both"))
            assert [w.worker_id for w in await reg.live_workers()] == ["w1"]
            p.kill()
            p.wait()
            with pytest.raises(Exception):
                await reg.heartbeat(rec("w1", "both"))  # the worker's loop logs this and keeps going
            p = start()
            assert await reg.live_workers() == []  # nothing persisted
            await reg.heartbeat(rec("w1", "both"))
            assert [w.worker_id for w in await reg.live_workers()] == ["w1"]
        finally:
            await reg.close()
            p.kill()
            p.wait()

    asyncio.run(main())


def test_router_list_workers_and_gateway_503(tiny_llama):
    """ListWorkers returns the registry's records with their load reports; with no live worker the gateway
    answers 503 (and /health 503)."""
    import httpx

    from pdserve.services.gateway.app import GatewayConfig, create_gateway

    async def main():
        model = f"test-{uuid.uuid4().hex[:8]}"
        reg = Registry(REDIS, model, ttl_s=1.0)
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(RouterService(reg, view_ttl_s=0), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            app = create_gateway(GatewayConfig(str(tiny_llama), model, f"127.0.0.1:{port}")).app
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                r = await c.post("/v1/completions", json={"model": model, "prompt": "the fox", "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"
                assert (await c.get("/health")).status_code == 503
                r = await c.post("/v1/completions", json={"model": model, "prompt": list(range(2, 600))})
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
                r = await c.post("/v1/chat/completions", json={"model": model, "messages": []})
                assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            stub = router_pb2_grpc.RouterStub(channel(f"127.0.0.1:{port}"))
            await reg.heartbeat(WorkerRecord("w9", "both", "127.0.0.1:1",
                                             load=common_pb2.LoadReport(worker_id="w9", num_running=2)))
            ws = await stub.ListWorkers(router_pb2.ListWorkersRequest(model=model))
            assert [x.worker_id for x in ws.workers] == ["w9"] and ws.loads[0].num_running == 2
            await asyncio.sleep(1.2)  # no more heartbeats: lapsed
            assert (await stub.ListWorkers(router_pb2.ListWorkersRequest(model=model))).workers == []
        finally:
            await server.stop(0)
            await drop_model_keys(reg.r, model)  # leave the shared Redis as found
            await reg.close()

    asyncio.run(main())


def test_registry_round_trips_a_typed_load_report():
    """The registry stores the worker's LoadReport as the proto itself (no JSON dict): every field, float and int,
    comes back equal, and the raw Redis hash parses as a LoadReport without pdserve's own decoder."""
    from pdserve.services.registry import workers_key

    async def main():
        model = f"test-{uuid.uuid4().hex[:8]}"
        reg = Registry(REDIS, model, ttl_s=5.0)
        load = common_pb2.LoadReport(worker_id="w1", num_running=3, num_waiting=4, kv_blocks_in_use=17,
                                     kv_blocks_total=64, pinned_blocks=5, prefix_hit_ratio=0.25,
                                     prefill_tokens_per_s=1234.5, prefill_overhead_s=0.0125, decode_step_s=0.031,
                                     decode_step_per_seq_s=0.0007, pending_prefill_tokens=900,
                                     kv_bytes_per_s=3.5e9, handoff_overhead_s=0.004, report_time=1.7e9 + 0.5,
                                     max_num_seqs=48)
        lay = common_pb2.KvLayout(fingerprint="fp", block_size=16, dtype="float16", num_layers=2, num_kv_heads=4,
                                  head_dim=8, block_bytes=4096)
        try:
            await reg.heartbeat(WorkerRecord("w1", "decode", "127.0.0.1:1", "agent-w1", 64, lay, load))
            raw = await reg.r.hgetall(workers_key(model, "w1"))
            assert common_pb2.LoadReport.FromString(raw[b"load"]) == load
            info = common_pb2.WorkerInfo.FromString(raw[b"info"])
            assert (info.role, info.address, info.agent_name, info.capacity_blocks, info.layout) == \
                ("decode", "127.0.0.1:1", "agent-w1", 64, lay)
            [back] = await reg.live_workers()
            assert back.load == load and back.layout == lay and back.role == "decode"
            assert back.load.max_num_seqs == 48 and back.load.prefill_tokens_per_s == 1234.5
        finally:
            await drop_model_keys(reg.r, model)
            await reg.close()

    asyncio.run(main())
