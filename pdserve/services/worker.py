"""`pdserve worker --role prefill|decode|both`: a gRPC Worker server around one engine.

prefill: Prefill + ReleaseKV (blocks pinned under leases, NIXL agent serving READs).
decode:  GenerateFromPrefill (pull with NIXL, then stream).
both:    Generate (the whole request here: colocated mode). Every role also answers Generate, so a
         deployment degrades to colocated serving rather than failing.
The worker heartbeats its record + load into Redis; SIGTERM drains (deregister, NOT_SERVING, wait for
in-flight requests, stop). The heartbeat never waits for the engine thread (a long step would let the registry
entry lapse): it reads the stats snapshot the engine thread publishes between steps.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from pdserve import env_knobs
from pdserve.cli_flags import engine_kwargs
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.grammar_limits import limits_from_args
from pdserve.engine.grammar_pool import DEFAULT_PROCESSES, CompileTimeout, GrammarPool
from pdserve.engine.request_state import RequestState
from pdserve.engine.spec_decode.flags import spec_config
from pdserve.engine.stats import EngineStats
from pdserve.engine.warmup import warm_up
from pdserve.kv_transfer.layout import KV_PROTOCOL_VERSION, KVLayout
from pdserve.services.convert import DeltaEncoder, layout_to_pb, limits_from_pb, params_from_pb, region_to_pb
from pdserve.services.decode.service import DecodeSide
from pdserve.services.grpc_util import (
    WORKER_SERVICE,
    abort_compile_timeout,
    listen,
    make_server,
    security,
    set_serving,
)
from pdserve.services.kv_endpoint import KvEndpoint
from pdserve.services.kv_events import KvEventPublisher, publish_forever
from pdserve.services.load_meter import LoadMeter
from pdserve.services.metrics import worker as M
from pdserve.services.pb import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.services.prefill.service import PrefillSide
from pdserve.services.refusal import refuse_invalid
from pdserve.services.registry import Registry, WorkerRecord
from pdserve.services.role_switch import (
    DRAIN,
    HANDOFF,
    MIGRATE,
    REFUSAL,
    SETTLE_S,
    RoleSwitch,
    SwitchRefused,
    SwitchResult,
    drain,
    resumable,
)

log = logging.getLogger("pdserve.worker")

# A worker whose engine thread has been inside one step or command this long is wedged, not busy: it stops
# heartbeating, so its registry entry lapses and nothing more is routed to it. Far above any real step (a full
# chunk of prefill is seconds at worst on a CPU), far below "forever".
ENGINE_STALL_S = 60.0


class Worker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: Engine, role: str, worker_id: str, address: str, lease_ttl_s: float = 30.0,
                 transfer_timeout_s: float = 10.0, grammars: GrammarPool | None = None):
        self.engine = engine
        self.switch = RoleSwitch(role)  # the role, and a switch in progress (role_switch.py)
        self.registry: Registry | None = None  # set by serve(): a switch writes its record at once
        self.drain_timeout_s = 30.0
        # `--switch-handoff`: a switch's streams finish here (drain) or move (migrate). Drain by default: on the
        # measured traces moving them bought no goodput (the decode workers a planner moves are mostly idle by
        # then), and a moved stream is re-prefilled on a decode worker that is busy (docs/planner.md)
        self.switch_handoff = DRAIN
        self.handed_off = 0  # streams ended by the switch in progress's handoff
        # one registry write at a time, the record taken inside: a heartbeat computed before a switch's step cannot
        # land after it (and put the old role back in the registry for an interval)
        self._publish_lock = asyncio.Lock()
        self.worker_id = worker_id
        self.address = address
        self.tokenizer = engine.tokenizer
        self.host = AsyncEngine(engine, grammars)
        # measured prefill rate / decode step / KV bandwidth for the router's cost model (docs/routing.md)
        self.meter = LoadMeter()
        self.host.add_step_listener(self.meter.on_step)
        # engine stats snapshot -> this worker's gauges and prefix-cache counters (metrics/worker.py)
        self.exporter = M.EngineStatsExporter([st.value for st in RequestState if not st.terminal])
        self.layout = KVLayout.from_dict(engine.kv_cache.layout())
        self.agent = None
        self.transport = None  # kv_transfer/transport.py: what the KV moves over (configured), P/D roles only
        self.ucx = None  # kv_transfer/ucx_log.py: UCX's log, with the transports it chose (P/D roles only)
        self.rank_agents = None  # the other TP ranks' agents (each rank reads/serves its own pool's heads)
        regions = []
        if role in ("prefill", "decode"):
            from pdserve.kv_transfer import transport
            self._make_agent()
            regions = [self.agent.region()]
            self.transport = transport.configured()
            M.set_transport_info(self.transport)
            if engine.tp_group is not None:
                from pdserve.kv_transfer.tp_ranks import RankAgents
                self.rank_agents = RankAgents(engine.tp_group.side)
                regions += self.rank_agents.open(worker_id, serve=role == "prefill", fingerprint=self.layout.fingerprint)
        self.endpoint = KvEndpoint(
            worker_id, address,
            # this process, as KvHandles name it: a decode worker re-does the KV handshake when it changes
            incarnation=uuid.uuid4().hex,
            # PDSERVE_FAULT_KV_PROTOCOL_VERSION: fault injection only (a worker of another release, in tests)
            protocol_version=int(env_knobs.get("PDSERVE_FAULT_KV_PROTOCOL_VERSION") or KV_PROTOCOL_VERSION),
            layout=self.layout,
            region=region_to_pb(regions[0]) if regions else common_pb2.KvRegion(),
            tp_regions=[region_to_pb(r) for r in regions] if len(regions) > 1 else [])
        self.prefill = PrefillSide(self.host, self.endpoint, self.agent, engine.pinned_kv, self.tokenizer, lease_ttl_s)
        self.decode = DecodeSide(self.host, self.endpoint, self.agent, self.tokenizer, self.meter, transfer_timeout_s,
                                 rank_agents=self.rank_agents, ucx=self.ucx)
        self.inflight = 0
        self.last_stats = EngineStats()
        self.labels: dict[str, str] = {}  # `--labels`, published in the registry for the router's spread terms

    def _make_agent(self) -> None:
        """This worker's NIXL agent, UCX's log set up around its creation (UCX reads its settings when NIXL first
        loads it): what UCX chose for each peer is read from that log (kv_transfer/ucx_log.py)."""
        from pdserve.kv_transfer.agent import KVAgent
        from pdserve.kv_transfer.ucx_log import UcxLog
        self.ucx = UcxLog()
        self.ucx.enable()
        try:
            self.agent = KVAgent(self.worker_id, self.engine.kv_cache.data, self.layout)
        finally:
            self.ucx.open()
        if not self.ucx.active:
            log.info("the KV transport UCX chooses per peer will show as unknown: %s", self.ucx.reason)

    @property
    def role(self) -> str:
        return self.switch.role

    # ---- helpers ----------------------------------------------------------------------------------------------
    def record(self) -> WorkerRecord:
        return WorkerRecord(self.worker_id, self.switch.registry_role, self.address,
                            self.agent.name if self.agent else "", self.engine.kv_cache.num_blocks,
                            layout_to_pb(self.layout.to_dict()), self.load(), labels=dict(self.labels),
                            kv_transport=self.transport.line() if self.transport else "",
                            kv_transport_observed=dict(self.decode.observed),
                            role_switch=self.switch.in_progress)

    def load(self) -> common_pb2.LoadReport:
        s = self.last_stats
        ld = self.meter.report()
        ld.worker_id = self.worker_id
        ld.num_running = s.num_running
        ld.num_waiting = s.num_waiting + self.inflight
        ld.kv_blocks_in_use = s.kv_blocks_in_use
        ld.kv_blocks_total = s.kv_blocks_total
        ld.pinned_blocks = self.prefill.leases.pinned_blocks()
        ld.prefix_hit_ratio = s.prefix_hit_ratio
        ld.max_num_seqs = self.engine.config.max_num_seqs
        ld.tensor_parallel_size = self.engine.config.tensor_parallel_size
        return ld

    def refresh_stats(self) -> EngineStats:
        """From the snapshot the engine thread published last: never waits for a step."""
        return self._use_stats(self.host.snapshot.stats)

    async def exact_stats(self) -> EngineStats:
        """Through the engine thread, after every command queued before it (waits for the current step)."""
        return self._use_stats(await self.host.run(lambda e: e.stats()))

    def _use_stats(self, s: EngineStats) -> EngineStats:
        self.last_stats = s
        self.exporter.update(s)
        return s

    @contextlib.contextmanager
    def _track(self):
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    async def _refuse_while_switching(self, context) -> None:
        # UNAVAILABLE before anything is emitted: the gateway places the request on another worker
        if not self.switch.accepts_work:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{REFUSAL}switching {self.switch.in_progress}")

    async def _require_role(self, role: str, context) -> None:
        if self.role != role:
            # placed by a router whose view predates a role switch: place it elsewhere (nothing emitted yet)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{REFUSAL}worker role is {self.role}, not {role}")
        await self._refuse_while_switching(context)

    # ---- RPCs -------------------------------------------------------------------------------------------------
    async def Generate(self, request, context):
        await self._refuse_while_switching(context)
        with self._track():
            params = params_from_pb(request.params)
            prompt = list(request.prompt_token_ids)  # the gateway tokenizes: `prompt` text is its front door's only
            enc = DeltaEncoder(self.tokenizer)
            finished = False
            lim = limits_from_pb(request.lifecycle)
            lim.apply_share(self.host, request.namespace)
            gen = self.host.generate(request.request_id, prompt, params, namespace=request.namespace,
                                     deadline=lim.deadline, priority=lim.priority,
                                     predicted_output_tokens=lim.predicted_output_tokens,
                                     resume_token_ids=list(request.resume.output_token_ids) or None)
            try:
                async with contextlib.aclosing(gen):
                    first = True
                    sent = 0
                    async for out in gen:
                        if first and out.outputs and any(c.new_token_ids for c in out.outputs):
                            M.observe_engine_times(out)
                            first = False
                        if not out.finished and sent and self._hand_off_now(params):
                            await self._hand_off(context)
                        if out.finished:
                            finished = True
                            M.TERMINAL.labels(out.state).inc()
                        msg = enc.encode(out)
                        yield msg
                        sent += _has_tokens(msg)
            except ValueError as e:
                finished = True
                await refuse_invalid(context, e)
            except CompileTimeout as e:
                finished = True
                await abort_compile_timeout(context, e)
            finally:
                if not finished:
                    M.TERMINAL.labels("CANCELLED").inc()

    async def Prefill(self, request, context):
        await self._require_role("prefill", context)
        with self._track():
            return await self.prefill.Prefill(request, context)

    async def GenerateFromPrefill(self, request, context):
        await self._require_role("decode", context)
        with self._track():
            params = params_from_pb(request.params)
            sent = 0
            async with contextlib.aclosing(self.decode.GenerateFromPrefill(request, context)) as msgs:
                async for msg in msgs:  # closed with this call, so its cleanup runs now, not at collection
                    if not msg.finished and sent and self._hand_off_now(params):
                        await self._hand_off(context)  # the closing above aborts the engine's request
                    yield msg
                    sent += _has_tokens(msg)

    async def ReleaseKV(self, request, context):
        return await self.prefill.ReleaseKV(request, context)

    async def KvHandshake(self, request, context):
        if self.role != "prefill":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker role is {self.role}, not prefill")
        return await self.prefill.KvHandshake(request, context)

    async def GetStats(self, request, context):
        s = await self.exact_stats()
        return worker_pb2.GetStatsResponse(load=self.load(), states=dict(s.states), role=self.switch.registry_role,
                                           role_switch=self.switch.in_progress)

    async def SwitchRole(self, request, context):
        try:
            r = await self.switch_role(request.role, request.drain_timeout_s or self.drain_timeout_s,
                                       request.handoff or self.switch_handoff)
        except SwitchRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return worker_pb2.SwitchRoleResponse(old_role=r.old_role, role=r.role, switched=r.switched, seconds=r.seconds,
                                             drain_s=r.drain_s, drained_requests=r.drained_requests, error=r.error,
                                             handed_off=r.handed_off, handoff=r.handoff)

    # ---- role switch (role_switch.py) -------------------------------------------------------------------------
    def _held(self) -> int:
        return self.inflight + len(self.prefill.leases)

    def _hand_off_now(self, params) -> bool:
        """Whether a stream that already sent a token ends here, before its next message: a `migrate` switch is
        draining and the gateway can resume the stream elsewhere. The message not sent is sampled again there
        (the resumed request continues from the tokens the client has); before any token the gateway would start
        the request over, repeating what else it was sent (prompt logprobs), so those wait for their first."""
        return self.switch.hands_off and resumable(params)

    async def _hand_off(self, context) -> None:
        self.handed_off += 1
        M.ROLE_SWITCH_HANDOFFS.inc()
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{HANDOFF}: switching {self.switch.in_progress}")

    async def switch_role(self, target: str, drain_timeout_s: float, handoff: str = "") -> SwitchResult:
        """Leave the old role's pool, finish what it holds (or, handoff `migrate`, hand its streams to the
        gateway's migration), take the new role, register. Raises SwitchRefused before anything changed; otherwise
        the worker serves again on return, in the new role or (drain timeout, failure) the old one."""
        t0 = time.monotonic()
        old = self.role
        handoff = handoff or self.switch_handoff
        if target == old:
            return SwitchResult(old, old, False, 0.0, 0.0, 0, error=f"already {old}", handoff=handoff)
        if target in ("prefill", "decode") and self.engine.tp_group is not None and self.agent is None:
            raise SwitchRefused("a tensor-parallel worker started as both cannot take a disaggregated role")
        self.switch.begin(target, handoff)
        self.handed_off = 0
        held = self._held()
        log.info("switching role %s -> %s: %s %d request(s)/lease(s)", old, target,
                 "handing off" if handoff == MIGRATE else "draining", held)
        await self._publish()  # role `switching` now: routers stop choosing this worker at their next refresh
        drained = await drain(self._held, drain_timeout_s, settle_s=min(SETTLE_S, drain_timeout_s))
        drain_s = time.monotonic() - t0
        error = "" if drained else f"drain timeout: {self._held()} still held after {drain_timeout_s:.1f}s"
        if drained:
            self.switch.fire("drained")
            try:
                await self._repartition(target)
                self.switch.fire("ready")
            except Exception as e:  # noqa: BLE001 - the old role stays, said in the reply and the log
                error = f"repartition failed: {e!r}"
                self.switch.fire("failed")
        else:
            self.switch.fire("timeout")
        self.switch.finish(switched=not error)
        await self._publish()
        secs = time.monotonic() - t0
        outcome = "switched" if not error else "drain_timeout" if not drained else "failed"
        M.ROLE_SWITCHES.labels(old, target, outcome).inc()
        if not error:
            M.ROLE_SWITCH_SECONDS.observe(secs)
            log.info("switched role %s -> %s in %.3fs (drain %.3fs, %d stream(s) handed off)", old, target, secs,
                     drain_s, self.handed_off)
        else:
            log.warning("role switch %s -> %s undone: %s", old, target, error)
        return SwitchResult(old, self.role, not error, secs, drain_s, held, error, self.handed_off, handoff)

    async def publish(self, registry: Registry | None = None) -> None:
        registry = registry or self.registry
        if registry is not None:
            async with self._publish_lock:
                await registry.heartbeat(self.record())

    async def _publish(self) -> None:
        with contextlib.suppress(Exception):  # the heartbeat loop writes it again shortly
            await self.publish()

    async def _repartition(self, target: str) -> None:
        """Every role has the same KV pool here; a worker without a KV transfer agent (started as `both`) gets one
        for a disaggregated role, and a decode side that pulls with it. The load meter starts over (its old
        figures were the old role's)."""
        self.meter.forget()
        if target == "both" or self.agent is not None:
            return
        self._make_agent()
        self.endpoint = dataclasses.replace(self.endpoint, region=region_to_pb(self.agent.region()))
        await self.decode.close()
        self.decode = DecodeSide(self.host, self.endpoint, self.agent, self.tokenizer, self.meter,
                                 self.decode.transfer_timeout_s, ucx=self.ucx)
        self.prefill.attach_agent(self.agent, self.endpoint)


def _has_tokens(msg: common_pb2.GenerateResponse) -> bool:
    return any(d.token_ids for d in msg.outputs)


async def _heartbeat_loop(w: Worker, registry: Registry | None, interval_s: float,
                          stall_s: float = ENGINE_STALL_S) -> None:
    # its own thread: in a pool shared with work that can block (a READ from a silent peer), the heartbeat waited
    # behind it and the worker left the registry while healthy
    poller = ThreadPoolExecutor(1, thread_name_prefix="pdserve-heartbeat")
    try:
        await _beat(w, registry, interval_s, stall_s, poller)
    finally:
        poller.shutdown(wait=False)


async def _beat(w: Worker, registry: Registry | None, interval_s: float, stall_s: float,
                poller: ThreadPoolExecutor) -> None:
    stalled, failures = False, 0
    loop = asyncio.get_running_loop()
    while True:
        wait = interval_s
        try:
            w.refresh_stats()
            if w.ucx is not None:  # UCX's warnings on to the worker's log (kv_transfer/ucx_log.py)
                await loop.run_in_executor(poller, w.ucx.poll)
            busy = w.host.busy_for()
            if busy > stall_s:
                if not stalled:
                    log.error("engine thread stuck in one step for %.0fs: leaving the registry until it moves", busy)
                stalled = True
            elif registry is not None:
                if stalled:
                    log.warning("engine thread moves again: rejoining the registry")
                stalled = False
                await w.publish(registry)
            if failures:
                log.warning("heartbeat succeeds again after %d failures", failures)
            failures = 0
        except Exception as e:  # Redis blips must not kill the worker; the TTL says whether it is live
            failures += 1
            if failures == 1 or failures % 20 == 0:  # said once, then now and then: Redis down is one event
                log.warning("heartbeat failed (%d in a row): %s", failures, e)
            # Soon again: a call that timed out dropped its connection, and the retry takes a new one; waiting a
            # whole interval after a hung one (bounded at a quarter TTL, registry.py) could let the entry lapse.
            wait = interval_s / 4
        await asyncio.sleep(wait)


def engine_config_from_args(args) -> EngineConfig:
    """The worker's EngineConfig: the engine flags given (cli_flags.ENGINE_FLAGS, the one list), speculative
    decoding's, and the fault-injection knob."""
    kw = engine_kwargs(args)
    if env_knobs.get("PDSERVE_FAULT_STEP_DELAY_S"):  # fault injection only (EngineConfig.fault_step_delay_s)
        kw["fault_step_delay_s"] = float(env_knobs.get("PDSERVE_FAULT_STEP_DELAY_S"))
    kw.update(spec_config(args))
    return EngineConfig(**kw)


def _grammar_pool(engine: Engine, args) -> GrammarPool:
    pool = GrammarPool(engine.tokenizer, engine.model_config.vocab_size, limits_from_args(args),
                       processes=getattr(args, "grammar_processes", None) or DEFAULT_PROCESSES)

    def observe(outcome: str, seconds: float) -> None:
        M.GRAMMAR_COMPILE_SECONDS.labels(outcome).observe(seconds)
        M.GRAMMAR_CACHE_BYTES.set(pool.cache.bytes)

    pool.observe = observe
    pool.start(lazy=getattr(args, "grammar_start", None) == "lazy")
    return pool


async def serve(args) -> None:
    from pdserve.services.metrics import exposition
    from pdserve.services.procutil import freeze_startup_heap, install_stop_signals
    if args.metrics_port:
        exposition.serve(exposition.exposition(M.WORKER, {"model": args.served_model_name, "role": args.role},
                                               args.metrics_compat), args.metrics_port, args.host)
    host = args.advertise_host or "127.0.0.1"
    worker_id = args.worker_id or f"{args.role}-{socket.gethostname()}-{args.port}"
    started = M.process_start_time() or time.time()
    engine, grammars = _load_and_warm(args, started)
    w = Worker(engine, args.role, worker_id, f"{host}:{args.port}", lease_ttl_s=args.lease_ttl,
               transfer_timeout_s=args.transfer_timeout, grammars=grammars)
    w.labels = dict(getattr(args, "labels", None) or {})
    w.drain_timeout_s = args.drain_timeout
    w.switch_handoff = getattr(args, "switch_handoff", None) or w.switch_handoff
    await w.host.start()
    await w.prefill.start()
    server, hs = make_server([WORKER_SERVICE])
    worker_pb2_grpc.add_WorkerServicer_to_server(w, server)
    listen(server, f"{args.host}:{args.port}")
    await server.start()
    from pdserve.services.redis_conn import RedisAuth
    registry = Registry(args.redis_url, args.served_model_name, ttl_s=args.heartbeat_ttl,
                        auth=RedisAuth.from_args(args), key=security().registry_key()) if args.redis_url else None
    w.refresh_stats()
    w.registry = registry
    if registry is not None:
        await w.publish()
    hb = asyncio.create_task(_heartbeat_loop(w, registry, args.heartbeat_ttl / 3))
    kv_pub = None
    if registry is not None:  # KV events -> the routers' prefix index (router/prefix_index.py)
        kv_pub = asyncio.create_task(publish_forever(
            w.host, KvEventPublisher(registry.r, args.served_model_name, worker_id,
                                     ttl_s=max(30.0, 10 * args.heartbeat_ttl))))
    freeze_startup_heap(f"worker {worker_id}")  # after warm-up: the engine's long-lived objects exist now
    await set_serving(hs, [WORKER_SERVICE], True)
    M.READY_SECONDS.labels("ready").set(time.time() - started)
    log.info("worker %s (%s) listening on %s:%d, %d KV blocks of %d bytes; %s", worker_id, args.role, args.host,
             args.port, engine.kv_cache.num_blocks, engine.kv_cache.block_bytes, engine.info.line())
    stop = install_stop_signals(args.drain_timeout, f"worker {worker_id}")
    await stop.wait()
    # drain: leave the registry first so nothing new is routed here, then let in-flight requests finish
    log.info("draining (%d in flight)", w.inflight)
    hb.cancel()
    if kv_pub is not None:
        kv_pub.cancel()
    await set_serving(hs, [WORKER_SERVICE], False)
    if registry is not None:
        with contextlib.suppress(Exception):
            await registry.deregister(worker_id)
    t_end = time.monotonic() + args.drain_timeout
    # A prefill worker's requests outlive their RPC: their KV stays pinned under a lease until a decode worker
    # pulls it. Wait for those pulls too (or the leases' own expiry), or a pull right after SIGTERM would fail.
    while (w.inflight or len(w.prefill.leases)) and time.monotonic() < t_end:
        await asyncio.sleep(0.05)
    await _close(w, server, engine, grammars, registry)
    log.info("worker %s stopped", worker_id)


def _load_and_warm(args, started: float):
    """The engine loaded and warmed up, and its grammar pool (whose processes start while the engine warms up)."""
    engine = Engine.from_pretrained(args.model, engine_config_from_args(args))
    M.set_engine_info(engine.info)
    grammars = _grammar_pool(engine, args)
    M.READY_SECONDS.labels("load").set(time.time() - started)
    # spec §1.5: the first forwards at each batch shape happen here, before anything can route to this worker
    warm = warm_up(engine)
    M.READY_SECONDS.labels("warmup").set(warm.seconds)
    log.info("warm-up: %d forwards at batch sizes %s in %.2fs", warm.forwards, warm.batch_sizes, warm.seconds)
    return engine, grammars


async def _close(w: Worker, server, engine: Engine, grammars, registry) -> None:
    """After the drain: the server, the worker's parts, the engine (and its other ranks), the NIXL agents."""
    await server.stop(grace=1)
    await w.decode.close()
    await w.prefill.stop()
    await w.host.stop()
    grammars.close()
    if w.rank_agents is not None:
        w.rank_agents.close()
    engine.close()
    if w.agent is not None:
        w.agent.close()
    if w.ucx is not None:
        w.ucx.poll()
        w.ucx.close()
    if registry is not None:
        await registry.close()
