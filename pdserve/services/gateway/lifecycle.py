"""The gateway's side of a request's life: ingress gate, admission + reservation, deadline, and the one billing
record. `handler.py` calls in here at four points (authorize, admit, first/last emit via Timing, finish).

Billing owner: the gateway. A client request may be several engine requests (n > 1 and multi-prompt requests
are fanned out; in disagg mode each sub-request is an engine request on the prefill worker and another on the
decode worker), and each engine writes its own per-engine-request record (`pdserve.usage` logger: diagnostics,
not billing). Only the gateway sees the client request whole, so it writes exactly one record per client request
(`pdserve.billing` logger, JSON line) when the request ends, whichever way it ends — including REJECTED at the
gateway. `RequestLifecycle.finish` is idempotent: a racing second terminal path (cancel vs timeout) is a no-op.

Cancellation safety: a client that goes away cancels the task serving it (Starlette cancels a streaming
response's scope, and anyio re-delivers the cancellation at every later await in that scope), so the terminal
work — reservation release, quota charge, the billing record, the terminal counter — never runs in the caller's
task. `finish` marks the record terminal synchronously and runs that work in a task the RequestLifecycle owns
(`spawn`); the caller only waits for it through `asyncio.shield`. `close()` drains the owned tasks at shutdown.

Counts (spec §1.7): `generated_tokens` = tokens the workers sampled for it (their final usage; tokens seen when a
stream broke); `emitted_tokens` = tokens handed to the client connection; `committed_tokens` = tokens in the
answer the client got whole (what is billed and charged to the tenant's quota, with the prompt tokens).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from pdserve.services import logs
from pdserve.services.admission import Admission, Ticket
from pdserve.services.gateway.billing import BillingRecord, BillingTimes
from pdserve.services.gateway.ingress import IngressGate
from pdserve.services.gateway.params import APIError
from pdserve.services.gateway.stages import kv_moved
from pdserve.services.gateway.tenants import DEFAULT_TENANT, Tenant
from pdserve.services.gateway.usage_ledger import OpenUsage, UsageLedger
from pdserve.services.metrics import gateway as M
from pdserve.services.prefix_pins import PrefixHit
from pdserve.services.tasks import OwnedTasks

billing_log = logging.getLogger("pdserve.billing")
# The errors app.py (HTTP disconnect) and grpc_front.py (gRPC cancel) end a request with when its client left.
CLIENT_GONE = ("client disconnected", "client cancelled")


@dataclass
class RequestRecord:
    request_id: str
    model: str
    tenant: Tenant = field(default_factory=lambda: DEFAULT_TENANT)
    arrival: float = field(default_factory=time.time)
    deadline: float | None = None
    prompt_tokens: int = 0
    generated: int = 0
    emitted: int = 0
    committed: int = 0
    cached_tokens: int = 0
    ticket: Ticket | None = None
    admitted_at: float | None = None
    first_emit: float | None = None
    last_emit: float | None = None
    state: str | None = None
    error: str | None = None
    outputs_per_choice: list[int] = field(default_factory=list)
    # the sub-requests' traces (stages.StageTrace): their mid-stream migrations and recomputed tokens
    traces: list = field(default_factory=list)
    # the durable open record (usage_ledger.py): its key, and whether it was opened (then closed at the end)
    usage_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    usage_open: bool = False
    # the open's Redis round trip, run beside admission (a rejection is told without waiting for it); awaited by
    # the terminal path before the close, so a close never overtakes its open
    usage_opening: asyncio.Future | None = None

    def billing(self) -> BillingRecord:
        """Its billing record, now that it ended (`state` set)."""
        t = self.ticket
        kv = kv_moved(self.traces)
        return BillingRecord(
            request_id=self.request_id, tenant=self.tenant.name, model=self.model, state=self.state,
            times=BillingTimes(arrival=self.arrival, finished=time.time(), admitted=self.admitted_at,
                               first_emit=self.first_emit, last_emit=self.last_emit, deadline=self.deadline,
                               queued_s=t.queued_s if t else 0.0),
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens, generated_tokens=self.generated,
            emitted_tokens=self.emitted, committed_tokens=self.committed,
            n_requested=t.n_requested if t else None, n_granted=t.n_granted if t else None,
            predicted_output_tokens=t.predicted_output if t else None, reserved_blocks=t.blocks if t else 0,
            admission=tuple(t.states) if t else (), error=self.error,
            migrations=sum(x.migrations for x in self.traces),
            recomputed_tokens=sum(x.recomputed_tokens for x in self.traces),
            kv_bytes=kv.nbytes if kv else 0, kv_transfer_s=round(kv.seconds, 6) if kv else 0.0)


class RequestLifecycle:
    def __init__(self, gate: IngressGate, admission: Admission | None, model: str,
                 default_timeout_s: float = 60.0, max_timeout_s: float = 600.0):
        self.gate = gate
        self.admission = admission
        self.model = model
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self.records_written = 0
        self._tasks = OwnedTasks(on_error=lambda e: billing_log.error("terminal path failed: %r", e))
        self.usage: UsageLedger | None = None  # durable open records (Redis); None: written at the end only

    def start(self) -> None:
        """Background work that needs the running loop (idempotent): the usage ledger's refresh / finalise."""
        if self.usage is not None:
            self.usage.start()

    def spawn(self, coro) -> asyncio.Task:
        """Run `coro` in a task this RequestLifecycle owns: it outlives the cancellation of whoever started it, its
        errors are logged, and `close()` waits for it."""
        return self._tasks.spawn(coro)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Shutdown: let in-flight terminal paths (release, charge, record) complete."""
        await self._tasks.wait(timeout_s)
        if self.usage is not None:
            await self.usage.stop()

    def new_record(self) -> RequestRecord:
        return RequestRecord(f"req-{uuid.uuid4().hex[:16]}", self.model)

    async def authorize(self, rec: RequestRecord, headers) -> None:
        """Stage one (after an HTTP body was read within its limits): API key -> tenant, quota and rate. `headers`:
        the HTTP headers or the gRPC call's metadata, as a mapping."""
        rec.tenant = self.gate.authenticate(headers)
        await self.gate.check_limits(rec.tenant)

    def deadline_for(self, timeout: float | None, rec: RequestRecord) -> float:
        """The request's `timeout` (seconds; None: the default), capped by the tenant / server maximum."""
        t = self.default_timeout_s if timeout is None else timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t):
            raise APIError(400, "invalid parameter 'timeout': must be a positive number of seconds",
                           param="timeout", code="invalid_parameter")
        cap = min(self.max_timeout_s, rec.tenant.max_timeout_s or self.max_timeout_s)
        rec.deadline = rec.arrival + min(float(t), cap)
        return rec.deadline

    async def admit(self, rec: RequestRecord, rid: str, prompts: list[list[int]], max_tokens: int | None, n: int,
                    context_len: int, allow_degrade: bool = True, hit: PrefixHit | None = None) -> Ticket | None:
        """Stage two: reserve KV for prompt + predicted output, less the placed worker's prefix-cache `hit`
        (pinned instead, prefix_pins.py). Returns the ticket (n may be lowered)."""
        rec.request_id = rid
        rec.prompt_tokens = sum(len(p) for p in prompts)
        if self.usage is not None:
            # opened as admission starts (it may queue the request): a replica that dies meanwhile still leaves a
            # record due. The open runs beside admission, so a rejection is not held up by its round trip; the
            # terminal path awaits it before the close. Marked open at once: whatever ends it runs the close.
            self.usage.start()
            rec.usage_open = True
            rec.usage_opening = asyncio.ensure_future(self.usage.open(OpenUsage(
                rec.usage_id, rid, logs.request_id.get(), rec.tenant.name, self.model, rec.prompt_tokens,
                rec.arrival, rec.deadline, self.usage.replica)))
        if self.admission is None:
            rec.admitted_at = time.time()  # nothing to wait for: admitted once parsed and tokenized
            return None
        self.admission.start()  # lease renewal task (needs the running loop)
        # several prompts: one reservation for all of them, sized by the longest (n per prompt)
        longest = max(len(p) for p in prompts)
        ticket = await self.admission.admit(rid, rec.tenant.name, longest, max_tokens, n * len(prompts),
                                            context_len, rec.deadline or (time.time() + self.default_timeout_s),
                                            allow_degrade=allow_degrade and len(prompts) == 1,
                                            share=rec.tenant.kv, hit=hit if len(prompts) == 1 else None)
        rec.ticket = ticket
        rec.admitted_at = time.time()
        if ticket.queued_s:
            M.ADMISSION_WAIT.observe(ticket.queued_s)
        if ticket.degraded:
            M.DEGRADED_TOTAL.inc()
            M.STATE_GAUGE.labels("DEGRADED").inc()
        return ticket

    async def finish(self, rec: RequestRecord, state: str, error: str | None = None) -> None:
        """The one terminal path at the gateway: release the reservation, charge the quota, write the record,
        count the terminal state — once per client request, whichever path gets here first. The work runs in an
        owned task, so cancelling the caller (the client left) cannot cut it short."""
        if rec.state is not None:
            return
        rec.state = state
        rec.error = error
        await asyncio.shield(self.spawn(self._finish(rec)))

    async def _finish(self, rec: RequestRecord) -> None:
        state = rec.state
        M.TERMINAL.labels(state).inc()
        self._count(rec)
        if state == "REJECTED":
            M.REJECT_LATENCY.observe(time.time() - rec.arrival)
        if self.admission is not None:
            if rec.ticket is not None and rec.ticket.degraded:
                M.STATE_GAUGE.labels("DEGRADED").dec()
            try:
                await self.admission.release(rec.request_id)
            finally:  # a failed release leaves the lease to lapse; the bill is still owed
                try:
                    self._learn(rec)
                finally:
                    await self._bill(rec)
        else:
            await self._bill(rec)

    @staticmethod
    def _count(rec: RequestRecord) -> None:
        """Per-request token counts and lengths of requests that were admitted (a rejected one ran nothing)."""
        if rec.state == "CANCELLED" and rec.error in CLIENT_GONE:
            M.CLIENT_DISCONNECTS.inc()
        if rec.state != "REJECTED" and rec.admitted_at is not None:
            M.PROMPT_TOKENS.inc(rec.prompt_tokens)
            M.GENERATION_TOKENS.inc(rec.generated)
            M.REQUEST_PROMPT_TOKENS.observe(rec.prompt_tokens)
            M.REQUEST_OUTPUT_TOKENS.observe(rec.generated)

    def _learn(self, rec: RequestRecord) -> None:
        """Admission's models learn from the finished request: output length, service-time error."""
        state = rec.state
        if state == "FINISHED":
            for n_out in rec.outputs_per_choice:
                self.admission.predictor.observe(rec.tenant.name, n_out)
        if state in ("FINISHED", "TIMED_OUT") and rec.admitted_at is not None:
            # deadline-aware admission learns how far its service-time estimate was off (for the tokens really
            # generated; a timed-out request's time is a lower bound, and it counts as such)
            per_choice = rec.emitted // max(1, rec.ticket.n_granted) if rec.ticket else 0  # streamed
            out = (max(rec.outputs_per_choice, default=0) or per_choice) if state == "FINISHED" else None
            # a request that moved to another worker mid-stream waited for the failure and prefilled again: its
            # time says nothing about the model's error, and after a worker's death dozens of them would teach
            # admission that everything is 2-4x slower (spurious deadline_unreachable for tens of seconds)
            migrated = any(x.migrations for x in rec.traces)
            self.admission.observe_finish(rec.ticket, time.time() - rec.admitted_at, out or None,
                                          finished=state == "FINISHED", calibrate=not migrated)

    async def _bill(self, rec: RequestRecord) -> None:
        if rec.usage_opening is not None:
            rec.usage_open = await rec.usage_opening
        record = rec.billing()
        if rec.usage_open and not await self.usage.close(rec.usage_id):
            # another replica finalised it, presuming this one dead (its liveness lapsed): one record only
            billing_log.warning("request %s: its usage record was finalised by another replica", rec.request_id)
            await self.gate.charge(rec.tenant, record.billed_tokens)
            return
        t = rec.tenant.name
        M.USAGE_RECORDS.labels(t, record.state).inc()
        for kind, v in (("prompt", record.billed_prompt_tokens),
                        ("generated", record.generated_tokens), ("emitted", record.emitted_tokens),
                        ("committed", record.committed_tokens), ("recomputed", record.recomputed_tokens)):
            if v:
                M.USAGE_TOKENS.labels(t, kind).inc(v)
        self.records_written += 1
        billing_log.info(json.dumps(record.to_json()))
        await self.gate.charge(rec.tenant, record.billed_tokens)

    def write_finalised(self, record: BillingRecord, u: OpenUsage) -> None:
        """A record finalised here for a dead replica's request: counted and logged like one of ours, under the
        request's own x-request-id."""
        M.USAGE_RECORDS.labels(record.tenant, record.state).inc()
        if record.prompt_tokens:
            M.USAGE_TOKENS.labels(record.tenant, "prompt").inc(record.prompt_tokens)
        token = logs.request_id.set(u.log_id)
        try:
            billing_log.info(json.dumps(record.to_json()))
        finally:
            logs.request_id.reset(token)


def build_lifecycle(cfg) -> RequestLifecycle:
    """From GatewayConfig: Redis (optional), keys file, ingress gate, admission over the worker registry."""
    from pdserve.services.admission import Admission, RegistryCapacity
    from pdserve.services.gateway.tenants import TenantDirectory
    from pdserve.services.reservations import ReservationLedger
    redis = None
    admission = None
    if cfg.redis_url:
        from pdserve.services.redis_conn import connect
        from pdserve.services.registry import Registry
        redis = connect(cfg.redis_url, cfg.redis_auth, socket_timeout=0.5, socket_connect_timeout=0.5)
        registry = Registry(cfg.redis_url, cfg.served_model_name, auth=cfg.redis_auth, key=cfg.registry_key)
        registry.r = redis
        ledger = ReservationLedger(redis, cfg.served_model_name, lease_s=cfg.reservation_lease_s)
        admission = Admission(ledger, RegistryCapacity(registry, cfg.kv_overcommit), max_queue=cfg.admission_queue,
                              max_queue_wait_s=cfg.max_queue_wait_s)
    gate = IngressGate(TenantDirectory(cfg.api_keys_file), redis, cfg.served_model_name, cfg.max_body_bytes,
                       cfg.body_timeout_s)
    life = RequestLifecycle(gate, admission, cfg.served_model_name, cfg.default_timeout_s, cfg.max_timeout_s)
    if redis is not None:
        life.usage = UsageLedger(redis, cfg.served_model_name, life.write_finalised)
    return life
