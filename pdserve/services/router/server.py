"""`pdserve router`: gRPC Router service: live worker view + prefix index (both from Redis) + a placement policy
selected by name (policy_registry.py; default cache-aware)."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from pdserve.services.grpc_util import ROUTER_SERVICE, listen, make_server, set_serving
from pdserve.services.internal_security import NONE, InternalSecurity
from pdserve.services.metrics import router as M
from pdserve.services.pb import router_pb2, router_pb2_grpc
from pdserve.services.redis_conn import NO_AUTH, RedisAuth
from pdserve.services.registry import Registry, WorkerRecord, record_to_pb
from pdserve.services.router import policy_registry
from pdserve.services.router.placement import NoWorkers, PlacementPolicy, PolicyContext, RouteInput
from pdserve.services.router.prefix_index import IndexSync
from pdserve.services.router.spread import RouteWeights
from pdserve.services.router.view import LiveView

log = logging.getLogger("pdserve.router")


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, registry: Registry, view_ttl_s: float = 0.2, mode: str = "auto",
                 policy: PlacementPolicy | None = None, weights: dict[str, float] | None = None,
                 placement: str = "cache-aware", local_stall_steps: float | None = None):
        self.registry = registry
        self.sync = IndexSync(registry.r, registry.model)
        self.view = LiveView(registry, self.sync, refresh_s=view_ttl_s)
        self.policy = policy or policy_registry.create(
            placement, PolicyContext(mode, self.sync.index, RouteWeights.of(weights), local_stall_steps))
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Build the view and the index from Redis (a restarted router resumes warm), then follow it."""
        await self.sync.start()
        await self.view.refresh()
        self._task = asyncio.create_task(self.view.run_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def _workers(self) -> list[WorkerRecord]:
        if self._task is None:  # used without start() (tests): read the registry directly
            await self.view.refresh()
        return self.view.records()

    async def Route(self, request, context):
        req = RouteInput(request.request_id, list(request.prompt_token_ids), request.num_prompt_tokens,
                         request.namespace, request.max_tokens, set(request.exclude_worker_ids), request.prefer)
        try:
            try:
                p = self.policy.place(await self._workers(), req=req)
            except NoWorkers:
                # The view is up to refresh_s old, while /health (ListWorkers) reads Redis: a worker that just
                # registered (or came back) must not be refused for the view's age. Re-read once, then give up.
                with contextlib.suppress(Exception):  # Redis down: the last view stands
                    await self.view.refresh()
                p = self.policy.place(self.view.records(), req=req)
        except NoWorkers as e:
            M.REJECTIONS.labels("no_workers").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        M.ROUTED.labels(p.mode).inc()
        resp = router_pb2.RouteResponse(mode=p.mode, reason=p.reason, cached_tokens=p.cached_tokens,
                                        decode_cached_tokens=p.decode_cached_tokens,
                                        predicted_ttft_s=p.ttft_s, predicted_e2e_s=p.e2e_s, debug=p.header())
        for name in ("prefill", "decode", "both"):
            rec = getattr(p, name)
            if rec is not None:
                getattr(resp, name).CopyFrom(record_to_pb(rec))
        return resp

    async def ListWorkers(self, request, context):
        # The same view Route places on: /health (which asks this) says ready only once routing sees the workers.
        ws = await self._workers()
        return router_pb2.ListWorkersResponse(
            workers=[record_to_pb(w) for w in ws],
            loads=[w.load for w in ws])


async def serve(host: str, port: int, redis_url: str, model: str, metrics_port: int | None = None,
                ttl_s: float = 3.0, mode: str = "auto", metrics_compat: str | None = None,
                security: InternalSecurity = NONE, redis_auth: RedisAuth = NO_AUTH, drain_s: float = 5.0,
                weights: dict[str, float] | None = None, placement: str = "cache-aware",
                local_stall_steps: float | None = None) -> None:
    """`security` must be what grpc_util.configure was given (the CLI does both): it keys the registry HMAC.
    SIGTERM: NOT_SERVING, in-flight Route calls get min(2, drain_s) s, and the process is gone by drain_s + grace
    (procutil.exit_deadline) even if Redis, which its teardown talks to, is not there."""
    from pdserve.services.metrics import exposition
    from pdserve.services.procutil import freeze_startup_heap, install_stop_signals
    if metrics_port:
        exposition.serve(exposition.exposition(M.ROUTER, {"model": model}, metrics_compat), metrics_port, host)
    registry = Registry(redis_url, model, ttl_s=ttl_s, auth=redis_auth, key=security.registry_key())
    await registry.r.ping()  # fail fast with a clear error when Redis is not there
    server, hs = make_server([ROUTER_SERVICE])
    svc = RouterService(registry, mode=mode, weights=weights, placement=placement,
                        local_stall_steps=local_stall_steps)
    await svc.start()
    router_pb2_grpc.add_RouterServicer_to_server(svc, server)
    listen(server, f"{host}:{port}")
    await server.start()
    freeze_startup_heap("router")
    await set_serving(hs, [ROUTER_SERVICE], True)
    log.info("router listening on %s:%d (model %s, placement %s, mode %s, index rebuilt with %d blocks, internal "
             "auth %s)", host, port, model, placement, mode, len(svc.sync.index), security.describe())
    stop = install_stop_signals(drain_s, "router")
    await stop.wait()
    await set_serving(hs, [ROUTER_SERVICE], False)
    await server.stop(grace=min(2.0, drain_s))
    await svc.stop()
    await registry.close()
