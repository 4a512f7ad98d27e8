"""The control loop: every interval scrape -> observe -> forecast -> simulate the pools as they are -> correct the
model from the observation -> size -> guard -> apply -> record.

The first scrape only sets the baseline (rates are differences of counters). A failing stage (a scrape, the
registry, the simulator, the connector) is counted (`pdserve_planner_errors_total{stage}`), logged, and the
interval is skipped: nothing is scaled on a guess. Intervals are kept on a fixed schedule (interval k starts at
t0 + k x interval; one that overran its slot is followed at once, the missed slots are not made up); each step's
own time is exported (`pdserve_planner_step_seconds`) and an overrun counted.
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from pdserve.planner import scrape
from pdserve.planner.correction import Correction
from pdserve.planner.costs import CostSmoother, live_costs
from pdserve.planner.decision import Decision
from pdserve.planner.guard_rails import Guard
from pdserve.planner.predictor import TrendPredictor
from pdserve.planner.sizing import PoolLimits, Sizer, Sizing, Workload
from pdserve.planner.surplus import Demand, PoolLoad, Source, can_give, pool_loads, shifted
from pdserve.planner.switching import SWITCH_S, SwitchCosts, drain_estimate, mark_switches
from pdserve.services import planner_record
from pdserve.services.metrics import planner as M
from pdserve.sim.workload import SLO

log = logging.getLogger("pdserve.planner")

# A shrink must hold for the window's largest rate x headroom x this: the counts for growing and for shrinking
# are taken 25% apart, so a rate (or a capacity, as the correction moves) hovering around one threshold does not
# add a replica and take it away again. 25% is about twice the spread of one 5 s interval's rate at 8 req/s
# (Poisson: 1/sqrt(40) = 16%, halved by the window max's bias to the high side).
SHRINK_MARGIN = 1.25
# The model is compared with the observation pooled over up to this many intervals served by the same counts (the
# histogram increments between their ends): a p90 of one 5 s interval at 2 req/s is the largest of ~10 requests.
POOL_INTERVALS = 3


@dataclass(frozen=True)
class PlannerConfig:
    redis_url: str
    model: str
    interval_s: float = 30.0
    slo_ttft: float = 0.5
    slo_tpot: float = 0.05
    limits: PoolLimits = PoolLimits()
    cooldown_s: float = 60.0
    window: int = 6
    headroom: float = 1.2
    attainment: float = 0.9
    costs_file: str | None = None
    dry_run: bool = False
    heartbeat_ttl: float = 3.0
    internal_token_file: str | None = None
    redis_password_file: str | None = None
    redis_ca_file: str | None = None
    grow_confirm: int = 2               # consecutive intervals the model must ask for more (guard_rails.py)
    background: bool = True             # capacities in the sizer's thread (False: inline, deterministic tests)
    switch_s: float = SWITCH_S          # a role switch's own time after its drain (switching.py)
    start_s: float = 30.0               # a new worker's time from asked for to serving (switching.py)

    @classmethod
    def from_args(cls, a, redis_url: str | None = None) -> "PlannerConfig":
        return cls(redis_url=redis_url or a.redis_url, model=a.served_model_name, interval_s=a.planner_interval,
                   slo_ttft=a.slo_ttft, slo_tpot=a.slo_tpot,
                   limits=PoolLimits(a.min_prefill, a.max_prefill, a.min_decode, a.max_decode),
                   cooldown_s=a.scale_down_cooldown if a.scale_down_cooldown is not None else 2 * a.planner_interval,
                   window=a.planner_window, headroom=a.headroom, attainment=a.attainment,
                   costs_file=getattr(a, "costs", None), dry_run=bool(getattr(a, "dry_run", False)),
                   heartbeat_ttl=a.heartbeat_ttl, internal_token_file=a.internal_token_file,
                   redis_password_file=a.redis_password_file, redis_ca_file=a.redis_ca_file,
                   start_s=getattr(a, "worker_start_s", None) or 30.0)


class Planner:
    def __init__(self, cfg: PlannerConfig, connector, metrics_urls: Callable[[], list[str]],
                 scrape_bearer: str | None = None):
        """`scrape_bearer`: sent with every scrape (the local planner's internal token, which its gateway's
        /metrics accepts); None for URLs an operator named, which the token must not reach."""
        from pdserve.services.internal_security import InternalSecurity
        from pdserve.sim.costmodel import LinearCostModel, load_cost_model
        self.cfg, self.connector, self.metrics_urls = cfg, connector, metrics_urls
        self.scrape_bearer = scrape_bearer
        self.key = InternalSecurity.from_files(cfg.internal_token_file).registry_key()
        self.base_cost = load_cost_model(cfg.costs_file) if cfg.costs_file else LinearCostModel()
        self.predictor = TrendPredictor(window=cfg.window)
        self.sizer = Sizer(cfg.limits, headroom=cfg.headroom, attainment=cfg.attainment, background=cfg.background)
        self.correction = Correction.default()
        self.smoother = CostSmoother()
        self.guard = Guard(cfg.limits, cfg.cooldown_s, confirm=cfg.grow_confirm)
        self._serving: dict[str, int] | None = None  # the pools' serving counts at the last decision
        self._steady_run = 0                          # consecutive intervals served by the same counts
        self._sims: deque[tuple] = deque(maxlen=POOL_INTERVALS)  # simulated p90s of those intervals
        self.snaps: deque[scrape.Snapshot] = deque(maxlen=POOL_INTERVALS + 1)  # at the last decisions' scrapes
        self.prev: scrape.Snapshot | None = None
        self.registry = None
        self.last: Decision | None = None

    async def _registry(self):
        if self.registry is None:
            from pdserve.services.redis_conn import RedisAuth
            from pdserve.services.registry import Registry
            self.registry = Registry(self.cfg.redis_url, self.cfg.model, ttl_s=self.cfg.heartbeat_ttl,
                                     auth=RedisAuth.from_files(self.cfg.redis_password_file, self.cfg.redis_ca_file),
                                     key=self.key)
        return self.registry

    async def step(self) -> Decision | None:
        stage = "scrape"
        t0 = time.monotonic()
        try:
            snap = await asyncio.to_thread(scrape.fetch, self.metrics_urls(), bearer=self.scrape_bearer)
            if self.prev is None:
                self.prev = snap
                self.snaps.append(snap)
                return None
            obs, self.prev = scrape.observe(self.prev, snap), snap
            self.snaps.append(snap)
            snaps = list(self.snaps)
            stage = "registry"
            reg = await self._registry()
            workers = await reg.live_workers()
            if hasattr(self.connector, "observe"):
                self.connector.observe(workers)
            stage = "connector"
            current = await asyncio.to_thread(self.connector.replicas)
            stage = "size"
            serving = {pool: sum(1 for w in workers if w.role == pool) for pool in ("prefill", "decode")}
            costs = self.smoother.smooth(live_costs(workers, self.base_cost))
            d = await asyncio.to_thread(self.decide, obs, costs, current, time.monotonic(), serving,
                                        lambda k: scrape.observe(snaps[-1 - k], snaps[-1]) if k < len(snaps) else None,
                                        pool_loads(workers))
            d.decide_s = time.monotonic() - t0
            if not self.cfg.dry_run:
                stage = "connector"
                await self._apply(d.pools)
                d.applied = True
            d.export()
            log.info(d.line())
            stage = "store"
            await planner_record.store(reg.r, self.cfg.model, d.to_json(), d.changed, self.key)
            self.last = d
            step_s = time.monotonic() - t0
            M.STEP_SECONDS.set(step_s)
            if step_s > self.cfg.interval_s:
                M.OVERRUNS.inc()
                log.warning("planner: the interval's step took %.1f s (interval %g s)", step_s, self.cfg.interval_s)
            return d
        except Exception as e:  # noqa: BLE001 - one bad interval must not end the loop
            M.ERRORS.labels(stage).inc()
            log.warning("planner: interval skipped, %s failed: %r", stage, e)
            return None

    def switch_costs(self, output_mean: float) -> SwitchCosts:
        return SwitchCosts(self.cfg.switch_s, self.cfg.start_s,
                           drain_estimate(output_mean, self.cfg.slo_ttft, self.cfg.slo_tpot))

    async def _apply(self, pools, now: float | None = None) -> None:
        """The decision's role switches first (mark_switches: a "switch" verdict's workers move to `switch_to`), then
        scaling of the pools going up or down. A switch the worker refused (a drain past its timeout) leaves the
        source pool as it was; the growing pool's scale then starts the worker the switch did not bring."""
        moved = set()
        clock = (lambda: now) if now is not None else time.monotonic  # noqa: E731 - a test's virtual time
        for v in pools:
            if v.action == "switch":
                for _ in range(v.current - v.desired):
                    if await asyncio.to_thread(self.connector.switch, v.pool, v.switch_to):
                        moved |= {v.pool, v.switch_to}
        for pool in moved:
            self.guard.applied(pool, clock())
        for v in pools:
            if v.action in ("up", "down"):
                await asyncio.to_thread(self.connector.scale, v.pool, v.desired)
                self.guard.applied(v.pool, clock())

    def decide(self, obs: scrape.Observation, costs, current: dict[str, int], now: float,
               serving: dict[str, int] | None = None,
               pooled: Callable[[int], scrape.Observation | None] | None = None,
               loads: dict[str, PoolLoad] | None = None) -> Decision:
        """One interval's decision from its observation (no I/O): forecast, simulate the pools as they are, correct
        the model by the observation, size, guard, pair a grow with a role switch. `serving`: registered workers per
        pool (None: all serve); `pooled(k)`: the observation over the last k intervals (None: only this interval's);
        `loads`: what each pool's workers measure (surplus.py; None: no switch on a measured surplus)."""
        pools = ("prefill", "decode")
        self.predictor.add(obs)
        fc = self.predictor.forecast()
        wl = Workload.of(fc.prompt_mean, fc.output_mean, fc.prefix_hit)
        serving = serving or current
        starting = {pool: max(0, current[pool] - serving[pool]) for pool in pools}
        # the interval was served by these counts throughout: none starting, none registered or left since the last
        steady = not any(starting.values()) and serving == self._serving
        self._serving = dict(serving)
        self._steady_run = self._steady_run + 1 if steady else 0
        span = max(1, min(POOL_INTERVALS, self._steady_run))
        cmp = (pooled(span) if pooled is not None and span > 1 else None) or obs
        sim = self._robust_sim(self.sizer.simulate_current(serving["prefill"], serving["decode"], cmp.rate, wl, costs),
                               span)
        self.correction.observe(cmp.requests, (cmp.ttft_p90, cmp.tpot_p90), sim, steady)
        slo_ttft, slo_tpot = self.correction.slo(self.cfg.slo_ttft, self.cfg.slo_tpot)
        slo = SLO(ttft=slo_ttft, tpot=slo_tpot)
        grow = self.sizer.size(fc.rate, wl, costs, slo)
        hold = self.sizer.size(fc.hold_rate * SHRINK_MARGIN, wl, costs, slo)
        if grow is None or hold is None:  # the first capacities are still being computed: hold the counts
            grow = hold = Sizing(current["prefill"], current["decode"], fc.rate, True, stale=True,
                                 note="capacities not computed yet")
        traffic = fc.hold_rate > 0 or obs.requests > 0
        violated = {
            "prefill": (f"TTFT p90 {obs.ttft_p90 * 1000:.0f} ms > SLO {self.cfg.slo_ttft * 1000:.0f} ms"
                        if obs.ttft_p90 is not None and obs.ttft_p90 > self.cfg.slo_ttft else None),
            "decode": (f"TPOT p90 {obs.tpot_p90 * 1000:.0f} ms > SLO {self.cfg.slo_tpot * 1000:.0f} ms"
                       if obs.tpot_p90 is not None and obs.tpot_p90 > self.cfg.slo_tpot else None)}
        measured = {"prefill": obs.ttft_p90 is not None, "decode": obs.tpot_p90 is not None}
        for pool in pools:
            M.MODEL.labels(pool).set(getattr(grow, pool))
        verdicts = [self.guard.decide(pool, current[pool], getattr(grow, pool), getattr(hold, pool),
                                      violated[pool], traffic, now, starting[pool],
                                      self.correction.checked_at_current(), hold.stale,
                                      measured[pool]) for pool in pools]
        if hasattr(self.connector, "switch"):
            verdicts = mark_switches(verdicts, self.switch_costs(fc.output_mean),
                                     self._giver(obs, fc, current, starting, violated, traffic, loads, now, hold))
        c = self.correction
        return Decision(time=time.time(), dry_run=self.cfg.dry_run, connector=self.connector.name,
                        observed_rate=obs.rate, forecast_rate=fc.rate, hold_rate=fc.hold_rate, trend=fc.trend,
                        prompt_mean=fc.prompt_mean, output_mean=fc.output_mean, prefix_hit=fc.prefix_hit,
                        queued=obs.queued, slo_ttft=self.cfg.slo_ttft, slo_tpot=self.cfg.slo_tpot,
                        observed_ttft_p90=obs.ttft_p90, observed_tpot_p90=obs.tpot_p90, simulated_ttft_p90=sim[0],
                        simulated_tpot_p90=sim[1], feasible=grow.feasible, note=grow.note, pools=verdicts,
                        correction_ttft=c.ttft.applied, correction_tpot=c.tpot.applied,
                        prefill_capacity=grow.prefill_capacity, decode_capacity=grow.decode_capacity,
                        model_stale=grow.stale, observed_requests=cmp.requests, correction_checked=c.checked,
                        compared_ttft_p90=cmp.ttft_p90, compared_tpot_p90=cmp.tpot_p90,
                        compared_intervals=span if cmp is not obs else 1)

    def _giver(self, obs, fc, current, starting, violated, traffic, loads, now, hold: Sizing):
        """surplus.can_give for a pool, on this interval's measurements (None without them)."""
        if loads is None:
            return None
        lim, seen = self.cfg.limits, obs.requests > 0
        prompt = obs.prompt_mean if seen and obs.prompt_mean is not None else fc.prompt_mean
        output = obs.output_mean if seen and obs.output_mean is not None else fc.output_mean
        hit = obs.prefix_hit if seen else fc.prefix_hit
        demand = Demand(fc.hold_rate, max(1.0, prompt * (1.0 - hit)), max(1.0, output), obs.tpot_p90)
        shift = shifted(hold.lengths, demand)
        if hold.lengths is None and hold.stale:  # no capacities computed yet: the model has no count to hold to
            shift, note = True, "; no capacities computed yet"
        elif shift:
            note = (f"; the model's capacities are for {hold.lengths[0]:.0f}/{hold.lengths[1]:.0f}-token "
                    f"prompts/outputs, this interval's {demand.prompt:.0f}/{demand.output:.0f}: a load shift")
        elif hold.lengths is not None:
            note = (f" (the model's capacities are for {hold.lengths[0]:.0f}/{hold.lengths[1]:.0f}-token "
                    "prompts/outputs{})")
        else:  # no load: the minimum, no capacities needed
            note = ""

        def give(pool: str) -> tuple[bool, str]:
            src = Source(current[pool], getattr(lim, f"min_{pool}"), starting[pool],
                         now - self.guard.last_change.get(pool, -1e18), self.cfg.cooldown_s,
                         violated[pool] is not None, traffic, None if shift else getattr(hold, pool),
                         note if shift else note.replace("{}", _model_count(pool, hold, self.cfg.headroom)))
            return can_give(pool, src, loads.get(pool), demand, self.cfg.slo_tpot, self.cfg.headroom)
        return give

    def _robust_sim(self, sim: tuple, span: int) -> tuple:
        """The median of the simulated p90s over the same intervals as the pooled observation: near its saturation
        a 100-request simulation's p90 jumps by 10x between neighbouring rates, and one jump must not move the
        correction more than one noisy observation does."""
        if span <= 1:
            self._sims.clear()
        self._sims.append(sim)
        out = []
        for i in range(len(sim)):
            xs = [s[i] for s in self._sims if s[i] is not None]
            out.append(statistics.median(xs) if xs else None)
        return tuple(out)

    async def run(self, stop: threading.Event) -> None:
        log.info("planner: every %g s, SLO TTFT %g s / TPOT %g s, pools prefill %d..%d decode %d..%d, connector %s%s",
                 self.cfg.interval_s, self.cfg.slo_ttft, self.cfg.slo_tpot, self.cfg.limits.min_prefill,
                 self.cfg.limits.max_prefill, self.cfg.limits.min_decode, self.cfg.limits.max_decode,
                 self.connector.name, " (dry run)" if self.cfg.dry_run else "")
        due = time.monotonic()
        try:
            while not stop.is_set():
                await self.step()
                due += self.cfg.interval_s
                if time.monotonic() > due:  # overran: start the next interval now, drop the missed slots
                    due = time.monotonic()
                while not stop.is_set() and time.monotonic() < due:
                    await asyncio.sleep(min(0.1, due - time.monotonic()))
        finally:
            await asyncio.to_thread(self.sizer.close)
            if self.registry is not None:
                await self.registry.close()


def _model_count(pool: str, hold: Sizing, headroom: float) -> str:
    """How the model's shrink count for `pool` came about, for the switch's reason: the rate it holds for (the
    window's largest x SHRINK_MARGIN), the headroom and one replica's simulated capacity."""
    cap = getattr(hold, f"{pool}_capacity")
    if cap is None or hold.rate <= 0:
        return ""
    if cap <= 0:
        return f"; one {pool} replica meets its SLO at no rate in corrected simulation: the pool's maximum"
    return (f"; {hold.rate:.2f} req/s (window max x {SHRINK_MARGIN:g}) x headroom {headroom:g} / {cap:.3g} req/s "
            f"one {pool} replica serves in corrected simulation")
