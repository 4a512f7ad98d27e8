"""Scheduler admission (spec §1.2 stage two, §5.5, Q13): after tokenize, reserve KV for prompt + predicted output.

The reservations themselves (the Redis ledger shared by every gateway replica, its Lua scripts, and the local
ledger that stands in while Redis is down) are `reservations.py`. Physical blocks are still taken only when an
engine tick selects the request.

Capacity = sum over serving workers (decode, or both) of KV blocks x `overcommit`; sequence slots = sum of
their `max_num_seqs`; read from the worker registry in Redis.

Output length prediction: `min(max_tokens, max(min_predict, p90 of this tenant's last 256 observed outputs))`
once 20 outputs were seen, else `max_tokens` (or the context left when it is unset). Underprediction is not
fatal: the engine preempts when blocks really run out.
KV of a request: prompt blocks once (the prefix cache shares them between the n branches, Q24) + n x output.

Outcomes: REJECTED 400 (the prompt can never fit a worker; the fewest copies allowed can never fit all of
them), DEGRADED (the largest n that fits, computed in the reserve script; the client is told), REJECTED 503
`deadline_unreachable` (it would fit, but is not expected to finish by its deadline at the current load:
`Admission`), QUEUED (waits for blocks/slots: bounded queue per replica), REJECTED 503 with Retry-After (queue
full), TIMED_OUT 503 `queue_deadline` (queued, then its deadline became unreachable), TIMED_OUT 504 (queue
deadline passed).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.services.kv_shares import NO_SHARE, KVShare
from pdserve.services.metrics import gateway as M
from pdserve.services.prefix_pins import PrefixHit
from pdserve.services.reservations import Plan, ReservationLedger

log = logging.getLogger("pdserve.admission")



class AdmissionError(Exception):
    def __init__(self, status: int, message: str, code: str, state: str, retry_after_s: float | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.state, self.retry_after_s, self.param = (
            status, message, code, state, retry_after_s, param)


@dataclass
class ServiceRates:
    """How fast the serving pool works, from the workers' measured load reports (`LoadMeter`: the figures the
    router's cost model reads, docs/routing.md). All 0 until a worker has measured a decode step.

    Model (processor sharing, spec §5.1: every running sequence gets one token per step): a request admitted
    while `in_flight` requests (itself included) share `workers` decode workers takes
        prefill_overhead + prompt / prefill_rate + output x (step0 + step_per_seq x in_flight / workers).
    """
    step0_s: float = 0.0             # decode step time extrapolated to an empty batch (mean over serving workers)
    step_per_seq_s: float = 0.0      # + this per sequence in the batch (measured slope)
    prefill_tokens_per_s: float = 0.0
    prefill_overhead_s: float = 0.0  # per-request prefill overhead (+ the KV hand-off in disagg mode)
    workers: int = 1                 # serving workers the requests in flight are spread over

    @property
    def measured(self) -> bool:
        return self.step0_s > 0 or self.step_per_seq_s > 0

    def prefill_s(self, prompt_tokens: int) -> float:
        rate = self.prefill_tokens_per_s
        return self.prefill_overhead_s + (prompt_tokens / rate if rate > 0 else 0.0)

    def step_s(self, in_flight: float) -> float:
        return self.step0_s + self.step_per_seq_s * in_flight / max(1, self.workers)

    def service_s(self, prompt_tokens: int, output_tokens: int, in_flight: float) -> float:
        return self.prefill_s(prompt_tokens) + output_tokens * self.step_s(in_flight)

    def max_in_flight(self, prompt_tokens: int, output_tokens: int, budget_s: float) -> float:
        """The most requests in flight (the new one included) at which `service_s` still fits `budget_s`; < 1:
        not even alone. inf when steps do not slow down with the batch (no slope measured)."""
        per_token = (budget_s - self.prefill_s(prompt_tokens)) / max(1, output_tokens)
        if per_token < self.step0_s or per_token <= 0:
            return 0.0
        if self.step_per_seq_s <= 0:
            return math.inf
        return (per_token - self.step0_s) * max(1, self.workers) / self.step_per_seq_s


@dataclass
class Capacity:
    blocks: int
    seqs: int
    block_size: int
    max_worker_blocks: int  # the largest single worker: a prompt needing more can never run
    rates: ServiceRates = field(default_factory=ServiceRates)


class Calibration:
    """Measured / estimated service time of the requests this replica admitted (EWMA of the ratio). The model
    above leaves things out — prefill chunks mixed into decode steps (the step figure is measured on pure-decode
    steps), reports up to a heartbeat old, requests admitted after this one — and this factor corrects for them
    from what actually happened. Clamped so one outlier cannot close or open the gate.

    Between observations the factor returns toward 1 with a half-life of `half_life_s`: only finished requests
    correct it, so a factor learned while a fault or a busy machine slowed everything (4.0 after 5% packet loss in
    the lab) would otherwise refuse the very requests whose finishing would bring it down, for as long as traffic
    is only of that kind. Where requests keep finishing, the EWMA's pull outweighs the decay."""

    def __init__(self, alpha: float = 0.1, lo: float = 0.5, hi: float = 4.0, half_life_s: float = 60.0,
                 clock=time.monotonic):
        self.alpha, self.lo, self.hi, self.half_life_s, self.clock = alpha, lo, hi, half_life_s, clock
        self._factor, self._at = 1.0, clock()
        self.samples = 0
        M.CALIBRATION.set_function(lambda: self.factor)  # the gateway's one; scraped as it decays

    @property
    def factor(self) -> float:
        decay = 0.5 ** ((self.clock() - self._at) / self.half_life_s)
        return 1.0 + (self._factor - 1.0) * decay

    def observe(self, estimated_s: float, actual_s: float) -> None:
        if estimated_s <= 0 or actual_s <= 0:
            return
        r = min(self.hi, max(self.lo, actual_s / estimated_s))
        self._factor = r if self.samples == 0 else (1 - self.alpha) * self.factor + self.alpha * r
        self._at = self.clock()
        self.samples += 1


class OutputPredictor:
    """Per-tenant running p90 of observed output lengths (this replica's observations)."""

    def __init__(self, window: int = 256, min_samples: int = 20, min_predict: int = 16):
        self.window, self.min_samples, self.min_predict = window, min_samples, min_predict
        self._obs: dict[str, deque[int]] = {}

    def observe(self, tenant: str, n_out: int) -> None:
        self._obs.setdefault(tenant, deque(maxlen=self.window)).append(int(n_out))

    def p90(self, tenant: str) -> int | None:
        obs = self._obs.get(tenant)
        if not obs or len(obs) < self.min_samples:
            return None
        s = sorted(obs)
        return s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]

    def predict(self, tenant: str, max_tokens: int | None, context_left: int) -> int:
        cap = min(max_tokens, context_left) if max_tokens is not None else context_left
        p = self.p90(tenant)
        if p is None:
            return max(1, cap)
        return max(1, min(cap, max(self.min_predict, p)))






@dataclass
class Ticket:
    rid: str
    blocks: int
    n_granted: int
    n_requested: int
    predicted_output: int
    queued_s: float = 0.0
    states: list[str] = field(default_factory=list)  # admission trail: QUEUED / DEGRADED
    # the service-time model at admission (rates 0: not measured): prefill + tokens x step(requests in flight).
    # `Calibration` compares it with what happened, for the tokens really generated at the mean load of its life
    rates: ServiceRates = field(default_factory=ServiceRates)
    prompt_tokens: int = 0
    in_flight: int = 1                       # requests in flight when admitted, itself included
    limit: float = math.inf                  # the most in flight its deadline allows (deadline_limit)
    life_mark: tuple[float, float] = (0.0, 0.0)  # InFlight.mark() at admission

    @property
    def degraded(self) -> bool:
        return self.n_granted < self.n_requested

    def estimated_s(self, output_tokens: int | None = None, in_flight: float | None = None) -> float:
        if not self.rates.measured:
            return 0.0
        out = self.predicted_output if output_tokens is None else output_tokens
        n = self.in_flight if in_flight is None else in_flight
        return self.rates.service_s(self.prompt_tokens, max(1, out), n)


def blocks_for(prompt_tokens: int, output_tokens: int, n: int, block_size: int, cached_tokens: int = 0) -> int:
    """Prompt blocks once (shared by n branches through the prefix cache), plus n x the output's blocks.
    Blocks already cached on the worker (`cached_tokens`) need no new memory."""
    return plan_for(prompt_tokens, output_tokens, n, block_size, cached_tokens).blocks(n)


# ---- the decision, pure (no I/O, no clock, no metrics) ----------------------------------------------------------
# `Admission.admit` below and the simulator (`pdserve.sim.admission`) both decide through these functions, so the
# simulated gateway admits, degrades, queues and rejects as the real one does for the same capacity.
def plan_for(prompt_tokens: int, pred: int, n: int, block_size: int, cached_tokens: int = 0,
             allow_degrade: bool = True) -> Plan:
    prompt = max(0, math.ceil(prompt_tokens / block_size) - cached_tokens // block_size)
    return Plan(prompt, math.ceil(pred / block_size), n, 1 if allow_degrade else n)


def prepare(predictor: OutputPredictor, tenant: str, prompt_tokens: int, max_tokens: int | None, n: int,
            context_len: int, cap: Capacity | None, cached_tokens: int = 0,
            allow_degrade: bool = True) -> tuple[int, Plan]:
    """The checks that need no ledger, then what to reserve: (predicted output, plan). Raises REJECTED 503 (no
    serving workers) or 400 (the prompt can never fit one worker; the fewest copies allowed can never fit all
    the workers' KV together: waiting would only end in a timeout)."""
    if cap is None:
        raise AdmissionError(503, "no serving workers", "no_workers", "REJECTED", 1.0)
    bs = cap.block_size
    if math.ceil((prompt_tokens + 1) / bs) > cap.max_worker_blocks:
        raise AdmissionError(400, f"prompt of {prompt_tokens} tokens can never fit a worker's KV cache "
                                  f"({cap.max_worker_blocks} blocks of {bs} tokens)", "context_length_exceeded",
                             "REJECTED", param="prompt")
    pred = predictor.predict(tenant, max_tokens, context_len - prompt_tokens)
    # never reserve more than one worker can hold: the request would wait forever
    pred = min(pred, cap.max_worker_blocks * bs - prompt_tokens)
    plan = plan_for(prompt_tokens, pred, n, bs, cached_tokens, allow_degrade)
    need = plan.blocks(plan.min_copies)
    if need > cap.blocks:
        what = (f"n={n} with allow_degrade false" if plan.min_copies > 1 else "the request")
        raise AdmissionError(400, f"{what} needs {need} KV blocks (prompt {plan.prompt_blocks} + "
                                  f"{plan.min_copies} x {plan.blocks_per_copy} for {pred} output tokens each); all "
                                  f"serving workers together hold {cap.blocks}: it can never be admitted",
                             "kv_capacity_exceeded", "REJECTED", param="n" if plan.min_copies > 1 else "max_tokens")
    return pred, plan


def make_ticket(rid: str, k: int, n: int, blocks: int, pred: int) -> Ticket:
    t = Ticket(rid, blocks, k, n, pred)
    if k < n:
        t.states.append("DEGRADED")
    return t


def no_fit(queued: int, max_queue: int, deadline: float, now: float, max_queue_wait_s: float) -> float:
    """Nothing fits now: the time to wait until (QUEUED), or REJECTED 503 when this replica's queue is full
    (bounded, so overload is told at once instead of piling up behind a queue that cannot drain)."""
    if queued >= max_queue:
        raise AdmissionError(503, "server at capacity; retry later", "capacity", "REJECTED", 1.0)
    return min(deadline, now + max_queue_wait_s)


# The share of a request's remaining time the service-time line may predict, at in-flight counts beyond those
# seen finishing, for the growth bound not to apply (Admission._try).
EXTRAPOLATION_HEADROOM = 0.25
# The growth bound never holds in-flight below this: a small burst is admitted on the model's word alone (one
# early, cold measurement must not cap a fresh deployment at two requests).
GROWTH_FLOOR = 8


def deadline_limit(rates: ServiceRates, factor: float, prompt_tokens: int, pred: int, remaining_s: float,
                   margin: float) -> float | None:
    """The most requests in flight (this one included) at which this request is expected to finish within
    `margin` x its remaining time; None when there is nothing to judge by (no rates measured yet)."""
    if not rates.measured:
        return None
    return rates.max_in_flight(prompt_tokens, pred, max(0.0, remaining_s) * margin / max(factor, 1e-6))


class InFlight:
    """Requests in flight in the shared ledger as last seen (every reserve call returns the count), kept current
    between calls with this replica's own admissions and releases; and its integral over time, so that the mean
    over a request's life — what its decode steps were really shared with — can be read back."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.n = 0
        self.area = 0.0
        self.t = clock()

    def set(self, n: int) -> None:
        now = self.clock()
        self.area += self.n * (now - self.t)
        self.t, self.n = now, max(0, int(n))

    def mark(self) -> tuple[float, float]:
        self.set(self.n)
        return self.area, self.t

    def mean_since(self, mark: tuple[float, float]) -> float | None:
        self.set(self.n)
        dt = self.t - mark[1]
        return (self.area - mark[0]) / dt if dt > 0 else None


class Admission:
    """Admission against the shared ledger, deadline-aware (docs/admission.md, "Deadline-aware admission").

    A request is admitted only if the KV blocks and sequence slots fit AND the requests in flight (itself
    included) stay at or below `deadline_limit`: the estimate from measured rates x `Calibration` says it then
    finishes within `margin` of its remaining time — and at or below the limits of the requests this replica
    already admitted, so a later admission does not push an earlier one past its deadline. (The limit of an
    admitted request stays about constant over its life: its remaining work and remaining time shrink together.)
    Under overload the count in flight therefore settles at the limit of a fresh request, where the model puts
    its completion at `margin` x its timeout. The limit goes into the same Redis script as the capacity check
    (its sequence limit), so the decision is atomic across replicas. When the capacity would take it but
    the deadline limit does not, waiting cannot help (the limit only shrinks as its time runs out, while later
    arrivals compete for each release): it is REJECTED 503 at once. It queues only for capacity (KV, slots), and
    leaves the queue with 503 (TIMED_OUT: its queue deadline, the latest start, passed) as soon as capacity is
    there but its deadline can no longer be met.
    """

    def __init__(self, ledger: ReservationLedger, capacity_fn, max_queue: int = 16, max_queue_wait_s: float = 10.0,
                 poll_s: float = 0.02, deadline_margin: float = 0.8):
        self.ledger = ledger
        self.capacity_fn = capacity_fn  # async () -> Capacity | None
        self.predictor = OutputPredictor()
        self.calibration = Calibration()
        self.deadline_margin = deadline_margin
        self.max_queue = max_queue
        self.max_queue_wait_s = max_queue_wait_s
        self.poll_s = poll_s
        self.held: dict[str, int] = {}  # this replica's live reservations (renewed)
        self.held_tenant: dict[str, str] = {}  # ... and their tenants (the ledger's per-tenant shares)
        self.held_pins: dict[str, tuple[str, ...]] = {}  # ... and the prefix-cache hits they hold (prefix_pins.py)
        # backstop: a request whose terminal path never ran (a bug, a response never started) stops being renewed
        # `orphan_grace_s` after its deadline, so its reservation expires like a crashed gateway's
        self.held_until: dict[str, float] = {}
        self.limits: dict[str, float] = {}  # held requests' in-flight limits (deadline_limit at admission)
        self.in_flight = InFlight()
        # the most requests in flight (mean over a life) at which requests of this replica were seen to finish
        # (so before their deadline): the deadline limit may exceed it only by `growth`, because the rates are
        # measured at the batches the workers have run, and a line extrapolated far beyond them (a fresh
        # deployment hit by a burst: measured at 16, asked about 64) let through a wave that all timed out
        self.proven = 0.0
        self.growth = 1.5
        self.orphan_grace_s = 30.0
        self.queued = 0
        self.degraded_live = 0
        self._released = asyncio.Event()
        self._renewer: asyncio.Task | None = None

    def start(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def stop(self) -> None:
        if self._renewer:
            self._renewer.cancel()
            with contextlib.suppress(BaseException):
                await self._renewer
        for rid in list(self.held):
            await self.release(rid)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ledger.lease_s / 3)
            now = time.time()
            for rid in [r for r, t in self.held_until.items() if t < now]:
                log.warning("admission: reservation %s outlived its deadline; dropped", rid)
                await self.release(rid)
            with contextlib.suppress(Exception):
                await self.renew_once()

    async def renew_once(self) -> None:
        held, pins = dict(self.held), dict(self.held_pins)
        await self.ledger.renew(held, dict(self.held_tenant), pins)
        # The renew script re-adds what it is given (that is how the ledger recovers after a Redis restart), so
        # a reservation released while the call was in flight came back: release it again; likewise pins
        # given up meanwhile (a lost hit), with the blocks the request now holds as its own.
        for rid in [r for r in held if r not in self.held]:
            await self.ledger.release(rid)
        for rid in [r for r in pins if r in self.held and r not in self.held_pins]:
            await self.ledger.unpin(rid, self.held[rid])
        blocks, reqs = await self.ledger.usage()
        M.RESERVED_BLOCKS.set(blocks)
        M.RESERVED_REQUESTS.set(reqs)

    async def admit(self, rid: str, tenant: str, prompt_tokens: int, max_tokens: int | None, n: int,
                    context_len: int, deadline: float, hit: PrefixHit | None = None,
                    allow_degrade: bool = True, share: KVShare | None = None) -> Ticket:
        """`share`: the tenant's KV share (reservations.py, "Tenant shares"); None: no guarantee, no cap.
        `hit`: the placed worker's prefix-cache hit (prefix_pins.py): its blocks are pinned, not reserved anew."""
        share = share if share is not None else KVShare(tenant, 0.0, 1.0, NO_SHARE.idle_s)
        cap = await self.capacity_fn()
        pins = hit.pins(cap.block_size) if hit is not None and cap is not None else ()
        cached_tokens = len(pins) * cap.block_size if pins else 0
        pred, plan = prepare(self.predictor, tenant, prompt_tokens, max_tokens, n, context_len, cap,
                             cached_tokens, allow_degrade)
        # without max_tokens and before this tenant has a history, the output length is a guess (the whole
        # context left): judging the deadline by it would turn away requests that end early
        judge = max_tokens is not None or self.predictor.p90(tenant) is not None
        t0 = time.monotonic()
        ticket, late = await self._try(rid, prompt_tokens, pred, plan, cap, deadline, judge, share, pins)
        if ticket is not None:
            self.held_until[rid] = deadline + self.orphan_grace_s
            return ticket
        if late is not None:
            raise AdmissionError(503, f"cannot finish within its deadline at the current load ({late[0]})",
                                 "deadline_unreachable", "REJECTED", late[1])
        queue_deadline = no_fit(self.queued, self.max_queue, deadline, time.time(), self.max_queue_wait_s)
        self.queued += 1
        M.STATE_GAUGE.labels("QUEUED").inc()
        try:
            while time.time() < queue_deadline:
                self._released.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._released.wait(), timeout=self.poll_s * 5)
                cap = await self.capacity_fn() or cap  # the pool may have changed while waiting
                pred, plan = prepare(self.predictor, tenant, prompt_tokens, max_tokens, n, context_len, cap,
                                     cached_tokens, allow_degrade)
                ticket, late = await self._try(rid, prompt_tokens, pred, plan, cap, deadline, judge, share, pins)
                if ticket is not None:
                    self.held_until[rid] = deadline + self.orphan_grace_s
                    ticket.queued_s = time.monotonic() - t0
                    ticket.states.insert(0, "QUEUED")
                    return ticket
                if late is not None:
                    raise AdmissionError(503, f"left the admission queue after {time.monotonic() - t0:.2f} s: "
                                              f"its deadline can no longer be met ({late[0]})", "queue_deadline",
                                         "TIMED_OUT", late[1])
        finally:
            self.queued -= 1
            M.STATE_GAUGE.labels("QUEUED").dec()
        raise AdmissionError(504, f"request timed out after {time.monotonic() - t0:.2f} s waiting for capacity",
                             "timeout", "TIMED_OUT")

    async def _try(self, rid: str, prompt_tokens: int, pred: int, plan: Plan, cap: Capacity, deadline: float,
                   judge: bool, share: KVShare = NO_SHARE, pins: tuple[str, ...] = ()
                   ) -> tuple[Ticket | None, tuple[str, float] | None]:
        """One reservation attempt. Returns (ticket, None) when admitted; (None, (why, retry after s)) when a
        deadline is what stands in the way; (None, None) when capacity is (or nothing could be judged)."""
        rates = cap.rates
        own = deadline_limit(rates, self.calibration.factor, prompt_tokens, pred, deadline - time.time(),
                             self.deadline_margin) if judge else None
        if own is not None and own < 1:
            alone = rates.service_s(prompt_tokens, pred, 1) * self.calibration.factor
            return None, (f"{pred} output tokens need ~{alone:.2f} s even alone, "
                          f"{max(0.0, deadline - time.time()):.2f} s left", 1.0)
        if own is not None and self.proven > 0:
            # Beyond what was seen finishing, trust the line only where an error of 1/EXTRAPOLATION_HEADROOM x
            # would still meet the deadline: a burst with time to spare (a fresh deployment, long timeouts) is
            # admitted; one the line says just fits is held to `growth` x the proven load.
            safe = deadline_limit(rates, self.calibration.factor, prompt_tokens, pred, deadline - time.time(),
                                  self.deadline_margin * EXTRAPOLATION_HEADROOM) or 0.0
            own = min(own, max(self.proven * self.growth + 1, safe, GROWTH_FLOOR))
        others = min(self.limits.values(), default=math.inf)
        limit = min(own if own is not None else math.inf, others)
        seq_limit = cap.seqs if limit >= cap.seqs else int(math.floor(limit))
        k, used, seqs = await self.ledger.reserve_plan(rid, plan, cap, seq_limit, share, pins)
        self.in_flight.set(seqs)
        if k > 0:
            self.held[rid] = plan.blocks(k)
            self.held_tenant[rid] = share.tenant
            if pins:
                self.held_pins[rid] = pins
            t = make_ticket(rid, k, plan.n, plan.blocks(k), pred)
            t.rates, t.prompt_tokens, t.in_flight, t.life_mark = rates, prompt_tokens, seqs, self.in_flight.mark()
            if own is not None:
                t.limit = self.limits[rid] = own
            return t, None
        if seqs + 1 <= limit:
            return None, None  # capacity (blocks, slots) stands in the way: worth waiting for
        # a deadline binds: in flight must drop from `seqs` to `seq_limit - 1`; at the pool's rate per request
        # (Little: in flight / service time) that takes about this long
        per_release = rates.service_s(prompt_tokens, pred, seqs) * self.calibration.factor / max(1, seqs)
        wait = max(1.0, (seqs + 1 - seq_limit) * per_release)
        whose = ("for it to finish in time" if own is not None and math.floor(own) <= others
                 else "for the requests admitted before it to finish in time")
        return None, (f"{seqs} requests in flight, at most {seq_limit} {whose}", wait)

    def observe_finish(self, ticket: Ticket | None, service_s: float, output_tokens: int | None,
                       finished: bool = False, calibrate: bool = True) -> None:
        """A request this replica admitted has ended (FINISHED, or TIMED_OUT by a worker): calibrate the model
        against it, evaluated at the mean number in flight over its life (not the number when it came in:
        later admissions share its steps too). `calibrate=False`: its time was not the model's to predict (it
        migrated after a worker died); it still counts as finished at that load."""
        if ticket is None:
            return
        mean = self.in_flight.mean_since(ticket.life_mark)
        if finished:
            self.proven = max(self.proven, mean if mean is not None else ticket.in_flight)
        if not ticket.rates.measured or not calibrate:
            return
        est = ticket.estimated_s(output_tokens, mean)
        self.calibration.observe(est, service_s)

    async def lose_hit(self, rid: str) -> None:
        """The request was placed elsewhere than where its hit is (a reroute before its prefill): it prefills
        the whole prompt, so its pins become blocks of its own, kept whatever the load (it is admitted and
        the engine preempts if memory really runs out). Idempotent; nothing to do without pins."""
        pins = self.held_pins.pop(rid, None)
        if not pins or rid not in self.held:
            return
        self.held[rid] += len(pins)
        await self.ledger.unpin(rid, self.held[rid])

    async def release(self, rid: str) -> None:
        """Idempotent: the reservation goes back whichever terminal path runs first."""
        self.held_until.pop(rid, None)
        self.limits.pop(rid, None)
        self.held_tenant.pop(rid, None)
        self.held_pins.pop(rid, None)
        if self.held.pop(rid, None) is None:
            return
        self.in_flight.set(self.in_flight.n - 1)
        await self.ledger.release(rid)
        self._released.set()


def capacity_from_workers(records, overcommit: float = 1.0, default_seqs: int = 64) -> Capacity | None:
    """Capacity of the serving pool: decode workers (they hold KV for the whole request) or `both` workers."""
    serving = [r for r in records if r.role == "decode"] or [r for r in records if r.role == "both"]
    if not serving:
        return None
    bs = serving[0].layout.block_size or 16
    blocks = [r.load.kv_blocks_total or r.capacity_blocks or 0 for r in serving]
    seqs = sum(r.load.max_num_seqs or default_seqs for r in serving)
    return Capacity(int(sum(blocks) * overcommit), seqs, bs, max(blocks), rates_from_workers(records, serving))


def rates_from_workers(records, serving) -> ServiceRates:
    """The pool's measured speed from the load reports (`LoadMeter.report`). A worker reports its decode step
    time at its current batch and the slope per sequence; the intercept is taken through that point, so the line
    is right where the worker is now, but never below the intercept of the worker's own fitted line: the point is
    a recent average (its batches varied) and the slope a long-run one, and through them a 30 ms step at 64
    sequences with a 0.5 ms slope gives an intercept of 0, i.e. a lone request decoding 64 tokens in 32 ms on a
    model whose batch-1 step is 2.4 ms (admitted, then timed out, CI). Unmeasured figures stay 0 (and deadlines
    are then not judged)."""
    d0s, d1s = [], []
    for r in serving:
        ld = r.load
        step = ld.decode_step_s
        if step <= 0:
            continue
        slope = ld.decode_step_per_seq_s
        batch = ld.num_running
        d1s.append(slope)
        d0s.append(max(ld.decode_step0_s, step - slope * batch, 0.0))
    if not d0s:
        return ServiceRates(workers=len(serving))
    prefill = [r for r in records if r.role in ("prefill", "both")] or serving
    rated = [r.load for r in prefill if r.load.prefill_tokens_per_s > 0]
    rate = max((ld.prefill_tokens_per_s for ld in rated), default=0.0)
    overhead = min((ld.prefill_overhead_s for ld in rated), default=0.0)
    handoff = sum(r.load.handoff_overhead_s for r in serving) / len(serving)
    return ServiceRates(sum(d0s) / len(d0s), sum(d1s) / len(d1s), rate, overhead + handoff, len(serving))


class RegistryCapacity:
    """Capacity read from the worker registry, cached for `ttl_s` (workers heartbeat about once a second).

    One caller at a time reads the registry when the cache is stale (it waits for that read); every other caller
    meanwhile gets the last capacity at once, or, before any is known, waits for that same read. Before, every
    request that arrived while the cache was stale read the registry itself: under a burst, dozens of reads in
    flight and 60-80 ms added to rejections that are promised within 100 ms (docs/admission.md).

    The service rates are smoothed over refreshes (`smooth`: weight of a new report): one report's decode step
    is an average over the last few steps at whatever batch they had, so the line through it jumps from report to
    report (measured: the intercept between 2 and 50 ms from one second to the next under steady load), and the
    deadline limit with it."""

    def __init__(self, registry, overcommit: float = 1.0, ttl_s: float = 1.0, smooth: float = 0.2):
        self.registry, self.overcommit, self.ttl_s, self.smooth = registry, overcommit, ttl_s, smooth
        self._cap: Capacity | None = None
        self._rates: ServiceRates | None = None
        self._at = float("-inf")
        self._reading: asyncio.Future | None = None  # set while one caller reads the registry

    async def __call__(self) -> Capacity | None:
        if time.monotonic() - self._at > self.ttl_s and self._reading is None:
            self._reading = done = asyncio.get_running_loop().create_future()
            try:
                await self._refresh()
            finally:  # cancelled too: the next caller reads
                self._reading = None
                done.set_result(None)
        elif self._cap is None and self._reading is not None:
            await asyncio.shield(self._reading)
        return self._cap

    async def _refresh(self) -> None:
        try:
            cap = capacity_from_workers(await self.registry.live_workers(), self.overcommit)
        except Exception as e:  # noqa: BLE001 - keep the last known capacity while Redis is away
            log.warning("admission: capacity not refreshed (%s)", e)
            return
        self._at = time.monotonic()
        if cap is not None:
            self._rates = cap.rates = smooth_rates(self._rates, cap.rates, self.smooth)
        self._cap = cap


def smooth_rates(old: ServiceRates | None, new: ServiceRates, a: float) -> ServiceRates:
    """EWMA of each measured figure; an unmeasured report keeps the last measured rates (an idle worker keeps
    its last numbers too), a change in the number of workers takes the new report as it is."""
    if not new.measured:
        return old if old is not None and old.workers == new.workers else new
    if old is None or not old.measured or old.workers != new.workers:
        return new

    def mix(x: float, y: float) -> float:
        return y if x <= 0 else x if y <= 0 else (1 - a) * x + a * y

    return ServiceRates(mix(old.step0_s, new.step0_s), mix(old.step_per_seq_s, new.step_per_seq_s),
                        mix(old.prefill_tokens_per_s, new.prefill_tokens_per_s),
                        mix(old.prefill_overhead_s, new.prefill_overhead_s), new.workers)
