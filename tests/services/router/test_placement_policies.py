"""Placement policies by name (services/router/policy_registry.py): the registry, a policy registered here used by
the router's Route and by the simulator, and a baseline selected by name placing alike in both."""
from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest

from pdserve.cli import PLACEMENTS, build_parser
from pdserve.services.grpc_util import channel
from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.registry import Registry, WorkerRecord
from pdserve.services.router import policy_registry
from pdserve.services.router.cache_aware import Policy
from pdserve.services.router.placement import Placement, PolicyContext, RouteInput
from pdserve.services.router.server import RouterService
from pdserve.sim.cluster import Cluster, ClusterSpec
from pdserve.sim.costmodel import LinearCostModel
from pdserve.sim.placer import RouterPlacer, RouterSpec
from pdserve.sim.workload import make_workload
from tests.services._workers import drop_model_keys

REDIS = "redis://127.0.0.1:6379/0"


class LastById:
    """A custom policy: the colocated worker whose id sorts last; remembers what it was asked."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def place(self, workers: list[WorkerRecord], *, req: RouteInput) -> Placement:
        self.prompts.append(list(req.prompt_token_ids))
        return Placement("colocated", both=max((w for w in workers if w.role == "both"), key=lambda w: w.worker_id),
                         reason="last_by_id")


@pytest.fixture
def last_by_id():
    built: list[LastById] = []

    def factory(ctx: PolicyContext) -> LastById:
        built.append(LastById())
        return built[-1]

    policy_registry.register("last-by-id", factory)
    try:
        yield built
    finally:
        del policy_registry.PLACEMENT_POLICIES["last-by-id"]


def _rec(wid: str, pending: int = 0) -> WorkerRecord:
    return WorkerRecord(wid, "both", f"127.0.0.1:{20000 + int(wid[1:])}",
                        load=common_pb2.LoadReport(kv_blocks_total=100, pending_prefill_tokens=pending))


async def _router(reg: Registry, placement: str):
    """A Router gRPC server selecting `placement` by name, and a stub to it."""
    svc = RouterService(reg, view_ttl_s=0, placement=placement)
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return svc, server, router_pb2_grpc.RouterStub(channel(f"127.0.0.1:{port}"))


def test_registry_lists_the_names_a_deployment_may_select():
    import pdserve.sim.baselines  # noqa: F401 (registers oracle)
    assert policy_registry.names() == ["cache-aware", "round-robin", "least-loaded"] == list(PLACEMENTS)
    assert policy_registry.names(sim=True) == [*PLACEMENTS, "oracle"]
    assert isinstance(policy_registry.create("cache-aware", PolicyContext("disagg")), Policy)
    args = build_parser().parse_args(["router", "--placement", "least-loaded"])
    assert args.placement == "least-loaded" and build_parser().parse_args(["router"]).placement == "cache-aware"


def test_unknown_name_is_refused_naming_the_choices():
    import pdserve.sim.baselines  # noqa: F401
    with pytest.raises(ValueError, match="unknown placement policy 'random': choose one of cache-aware, "
                                         "round-robin, least-loaded$"):
        policy_registry.create("random", PolicyContext())
    # the oracle reads the simulator's replicas: a deployment cannot select it, and is told why
    with pytest.raises(ValueError, match="'oracle' \\(it needs the simulator's replicas\\).*least-loaded$"):
        policy_registry.create("oracle", PolicyContext())
    with pytest.raises(ValueError, match="already registered"):
        policy_registry.register("round-robin", lambda ctx: Policy())
    with pytest.raises(ValueError, match="router policy must be one of cache-aware, round-robin, least-loaded, "
                                         "oracle"):
        RouterSpec(policy="random").validate()


def test_custom_policy_places_in_the_router(last_by_id):
    async def main():
        model = f"test-{uuid.uuid4().hex[:8]}"
        reg = Registry(REDIS, model)
        for w in ("b0", "b1", "b2"):
            await reg.heartbeat(_rec(w))
        svc, server, stub = await _router(reg, "last-by-id")
        try:
            r = await stub.Route(router_pb2.RouteRequest(request_id="x", prompt_token_ids=[1, 2, 3]))
            assert r.mode == "colocated" and r.both.worker_id == "b2" and r.reason == "last_by_id"
            assert svc.policy is last_by_id[0] and last_by_id[0].prompts == [[1, 2, 3]]
        finally:
            await server.stop(None)
            await drop_model_keys(reg.r, model)
            await reg.close()

    asyncio.run(main())


def test_custom_policy_places_in_the_simulator(last_by_id):
    spec = ClusterSpec(colocated=3, num_blocks=64, admission=None, router=RouterSpec(policy="last-by-id"))
    reqs = Cluster(spec, LinearCostModel(a=0.01, b=1e-4, c=1e-3)).run(make_workload(6, 5.0, "fixed:20", "fixed:2",
                                                                                     seed=1))
    assert {r.prefill_replica for r in reqs} == {"both-2"}
    assert len(last_by_id) == 1 and len(last_by_id[0].prompts) == 6


@pytest.mark.parametrize("name", ["round-robin", "least-loaded"])
def test_baseline_by_name_places_as_in_the_simulator(name):
    """The same view (the records the router reads from Redis), the same requests: the router's Route and the
    simulator's placer pick the same worker each time. Loads are chosen so least-loaded never meets a tie (its
    tie-break is random)."""
    async def main():
        model = f"test-{uuid.uuid4().hex[:8]}"
        reg = Registry(REDIS, model)
        for w, pending in (("b0", 0), ("b1", 20), ("b2", 45)):
            await reg.heartbeat(_rec(w, pending))
        svc, server, stub = await _router(reg, name)
        sim = RouterPlacer([], RouterSpec(policy=name), report_s=1.0, clock=time.time)  # the router's clock
        try:
            view = await reg.live_workers()
            routed, simulated = [], []
            for i in range(12):
                r = await stub.Route(router_pb2.RouteRequest(request_id=f"r{i}", prompt_token_ids=list(range(16))))
                routed.append(r.both.worker_id)
                simulated.append(sim.policy.place(view, req=RouteInput(f"r{i}", list(range(16)))).both.worker_id)
            assert routed == simulated and len(set(routed)) == 3
        finally:
            await server.stop(None)
            await drop_model_keys(reg.r, model)
            await reg.close()

    asyncio.run(main())
