"""A worker the gateway saw die is left out of its placements (gateway/suspects.py) while the registry still lists
it, and never at the price of a refusal: real Redis registry, real Router gRPC service, the gateway's Dispatcher."""
import asyncio
import uuid

import grpc

from pdserve.services.gateway.dispatch import Dispatcher
from pdserve.services.gateway.suspects import Suspects
from pdserve.services.pb import common_pb2, router_pb2_grpc
from pdserve.services.registry import Registry, WorkerRecord
from pdserve.services.router.server import RouterService
from tests.services._workers import drop_model_keys

REDIS = "redis://127.0.0.1:6379/0"


def test_suspicion_expires_after_its_hold():
    now = [100.0]
    s = Suspects(hold_s=5.0, clock=lambda: now[0])
    s.add("d1")
    now[0] = 102.0
    s.add("d2")
    assert s.current() == ["d1", "d2"]
    assert s.with_(["p0", "d2"]) == ["p0", "d2", "d1"]  # each once, the caller's first
    now[0] = 105.0  # d1's 5 s are over, d2 has 2 left
    assert s.current() == ["d2"]
    now[0] = 107.0
    assert s.current() == [] and s.with_(["x"]) == ["x"]
    s.add("")  # a placement without a worker id names nobody
    assert s.current() == []


def _rec(wid: str) -> WorkerRecord:
    return WorkerRecord(wid, "both", f"127.0.0.1:{20000 + int(wid[-1])}",
                        load=common_pb2.LoadReport(kv_blocks_total=100))


def test_dispatcher_skips_a_suspect_the_registry_still_lists():
    async def main():
        model = f"test-{uuid.uuid4().hex[:8]}"
        reg = Registry(REDIS, model, ttl_s=30)
        for w in ("b1", "b2"):
            await reg.heartbeat(_rec(w))
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(RouterService(reg, view_ttl_s=0), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            d = Dispatcher(f"127.0.0.1:{port}", model)
            picked = {(await d.route(f"r{i}", 8, "", [])).both.worker_id for i in range(8)}
            assert picked == {"b1", "b2"}  # both placed on while neither is suspected
            d.suspects.add("b1")  # e.g. a call to it just ended UNAVAILABLE
            assert {(await d.route(f"s{i}", 8, "", [])).both.worker_id for i in range(8)} == {"b2"}
            # the caller's own exclusion plus the suspect leave nothing: asked again without the suspect
            assert (await d.route("t", 8, "", ["b2"])).both.worker_id == "b1"
        finally:
            await server.stop(0)
            await drop_model_keys(reg.r, model)
            await reg.close()

    asyncio.run(main())
