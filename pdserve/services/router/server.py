"""`pdserve router`: gRPC Router service over the Redis registry."""
from __future__ import annotations

import logging
import time

import grpc

from pdserve.services import metrics as M
from pdserve.services.grpc_util import ROUTER_SERVICE, make_server, set_serving
from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.registry import Registry, WorkerRecord
from pdserve.services.router.policy import NoWorkers, Policy

log = logging.getLogger("pdserve.router")


def record_to_pb(r: WorkerRecord) -> common_pb2.WorkerInfo:
    from pdserve.services.pb import layout_to_pb
    return common_pb2.WorkerInfo(worker_id=r.worker_id, role=r.role, address=r.address, agent_name=r.agent_name,
                                 capacity_blocks=r.capacity_blocks, layout=layout_to_pb(r.layout))


def record_from_pb(w: common_pb2.WorkerInfo, load: common_pb2.LoadReport | None = None) -> WorkerRecord:
    from pdserve.services.pb import layout_from_pb
    ld = {f.name: getattr(load, f.name) for f in load.DESCRIPTOR.fields} if load is not None else {}
    return WorkerRecord(w.worker_id, w.role, w.address, w.agent_name, w.capacity_blocks,
                        layout_from_pb(w.layout) if w.HasField("layout") else {}, ld)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, registry: Registry, view_ttl_s: float = 0.2):
        self.registry = registry
        self.policy = Policy()
        self.view_ttl_s = view_ttl_s
        self._view: list[WorkerRecord] = []
        self._view_at = 0.0

    async def _workers(self) -> list[WorkerRecord]:
        # A short-lived cache: Redis is local and fast, but not worth one round trip per request under load.
        if time.monotonic() - self._view_at > self.view_ttl_s:
            self._view = await self.registry.live_workers()
            self._view_at = time.monotonic()
        return self._view

    async def Route(self, request, context):
        try:
            p = self.policy.place(await self._workers(), exclude=set(request.exclude_worker_ids))
        except NoWorkers as e:
            M.REJECTIONS.labels("no_workers").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        M.ROUTED.labels(p.mode).inc()
        resp = router_pb2.RouteResponse(mode=p.mode)
        for name in ("prefill", "decode", "both"):
            rec = getattr(p, name)
            if rec is not None:
                getattr(resp, name).CopyFrom(record_to_pb(rec))
        return resp

    async def Register(self, request, context):
        await self.registry.heartbeat(record_from_pb(request))
        self._view_at = 0.0
        return router_pb2.RegisterResponse(heartbeat_ttl_s=int(self.registry.ttl_s))

    async def Heartbeat(self, request, context):
        await self.registry.heartbeat(record_from_pb(request.worker, request.load))
        return router_pb2.HeartbeatResponse()

    async def KvEvents(self, request_iterator, context):
        n = 0
        async for ev in request_iterator:
            await self.registry.kv_event(ev.worker_id, ev.kind, ev.namespace, list(ev.block_hashes))
            n += 1
        return router_pb2.KvEventsAck(received=n)

    async def ListWorkers(self, request, context):
        ws = await self.registry.live_workers()
        return router_pb2.ListWorkersResponse(
            workers=[record_to_pb(w) for w in ws],
            loads=[common_pb2.LoadReport(worker_id=w.worker_id, **{k: v for k, v in w.load.items()
                                                                  if k in common_pb2.LoadReport.DESCRIPTOR.fields_by_name
                                                                  and k != "worker_id"}) for w in ws])


async def serve(host: str, port: int, redis_url: str, model: str, metrics_port: int | None = None,
                ttl_s: float = 3.0) -> None:
    from pdserve.services.procutil import install_stop_signals, start_metrics_server
    if metrics_port:
        start_metrics_server(metrics_port)
    registry = Registry(redis_url, model, ttl_s=ttl_s)
    await registry.r.ping()  # fail fast with a clear error when Redis is not there
    server, hs = make_server([ROUTER_SERVICE])
    router_pb2_grpc.add_RouterServicer_to_server(RouterService(registry), server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await set_serving(hs, [ROUTER_SERVICE], True)
    log.info("router listening on %s:%d (model %s)", host, port, model)
    stop = install_stop_signals()
    await stop.wait()
    await set_serving(hs, [ROUTER_SERVICE], False)
    await server.stop(grace=2)
    await registry.close()
