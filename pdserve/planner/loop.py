"""The control loop: every interval scrape -> observe -> forecast -> size (simulator) -> guard -> apply -> record.

The first scrape only sets the baseline (rates are differences of counters). A failing stage (a scrape, the
registry, the simulator, the connector) is counted (`pdserve_planner_errors_total{stage}`), logged, and the
interval is skipped: nothing is scaled on a guess.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from pdserve.planner import scrape
from pdserve.planner.costs import live_costs
from pdserve.planner.decision import Decision
from pdserve.planner.guard import Guard
from pdserve.planner.policy import PoolLimits, Sizer
from pdserve.planner.predictor import TrendPredictor
from pdserve.services import planner_record
from pdserve.services.metrics import planner as M
from pdserve.sim.workload import SLO

log = logging.getLogger("pdserve.planner")


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

    @classmethod
    def from_args(cls, a, redis_url: str | None = None) -> "PlannerConfig":
        return cls(redis_url=redis_url or a.redis_url, model=a.served_model_name, interval_s=a.planner_interval,
                   slo_ttft=a.slo_ttft, slo_tpot=a.slo_tpot,
                   limits=PoolLimits(a.min_prefill, a.max_prefill, a.min_decode, a.max_decode),
                   cooldown_s=a.scale_down_cooldown if a.scale_down_cooldown is not None else 2 * a.planner_interval,
                   window=a.planner_window, headroom=a.headroom, attainment=a.attainment,
                   costs_file=getattr(a, "costs", None), dry_run=bool(getattr(a, "dry_run", False)),
                   heartbeat_ttl=a.heartbeat_ttl, internal_token_file=a.internal_token_file,
                   redis_password_file=a.redis_password_file, redis_ca_file=a.redis_ca_file)


class Planner:
    def __init__(self, cfg: PlannerConfig, connector, metrics_urls: Callable[[], list[str]]):
        from pdserve.services.internal_security import InternalSecurity
        from pdserve.sim.costmodel import LinearCostModel, load_cost_model
        self.cfg, self.connector, self.metrics_urls = cfg, connector, metrics_urls
        self.key = InternalSecurity.from_files(cfg.internal_token_file).registry_key()
        self.base_cost = load_cost_model(cfg.costs_file) if cfg.costs_file else LinearCostModel()
        self.slo = SLO(ttft=cfg.slo_ttft, tpot=cfg.slo_tpot)
        self.predictor = TrendPredictor(window=cfg.window)
        self.sizer = Sizer(self.slo, cfg.limits, headroom=cfg.headroom, attainment=cfg.attainment)
        self.guard = Guard(cfg.limits, cfg.cooldown_s)
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
        try:
            snap = await asyncio.to_thread(scrape.fetch, self.metrics_urls())
            if self.prev is None:
                self.prev = snap
                return None
            obs, self.prev = scrape.observe(self.prev, snap), snap
            stage = "registry"
            reg = await self._registry()
            workers = await reg.live_workers()
            if hasattr(self.connector, "observe"):
                self.connector.observe(workers)
            stage = "connector"
            current = await asyncio.to_thread(self.connector.replicas)
            stage = "size"
            serving = {pool: sum(1 for w in workers if w.role == pool) for pool in ("prefill", "decode")}
            d = await asyncio.to_thread(self.decide, obs, live_costs(workers, self.base_cost), current,
                                        time.monotonic(), serving)
            if not self.cfg.dry_run:
                stage = "connector"
                for v in d.pools:
                    if v.action != "hold":
                        await asyncio.to_thread(self.connector.scale, v.pool, v.desired)
                        self.guard.applied(v.pool, time.monotonic())
                d.applied = True
            d.export()
            log.info(d.line())
            stage = "store"
            await planner_record.store(reg.r, self.cfg.model, d.to_json(), d.changed, self.key)
            self.last = d
            return d
        except Exception as e:  # noqa: BLE001 - one bad interval must not end the loop
            M.ERRORS.labels(stage).inc()
            log.warning("planner: interval skipped, %s failed: %r", stage, e)
            return None

    def decide(self, obs: scrape.Observation, costs, current: dict[str, int], now: float,
               serving: dict[str, int] | None = None) -> Decision:
        """One interval's decision from its observation (no I/O): forecast, size by simulation, guard.
        `serving`: registered workers per pool (None: all counted replicas serve)."""
        self.predictor.add(obs)
        fc = self.predictor.forecast()
        grow = self.sizer.size(fc.rate, fc.prompt_mean, fc.output_mean, fc.prefix_hit, costs)
        hold = self.sizer.size(fc.hold_rate, fc.prompt_mean, fc.output_mean, fc.prefix_hit, costs)
        traffic = fc.hold_rate > 0 or obs.requests > 0
        violated = {
            "prefill": (f"TTFT p90 {obs.ttft_p90 * 1000:.0f} ms > SLO {self.cfg.slo_ttft * 1000:.0f} ms"
                        if obs.ttft_p90 is not None and obs.ttft_p90 > self.cfg.slo_ttft else None),
            "decode": (f"TPOT p90 {obs.tpot_p90 * 1000:.0f} ms > SLO {self.cfg.slo_tpot * 1000:.0f} ms"
                       if obs.tpot_p90 is not None and obs.tpot_p90 > self.cfg.slo_tpot else None)}
        for pool in ("prefill", "decode"):
            M.MODEL.labels(pool).set(getattr(grow, pool))
        starting = {pool: max(0, current[pool] - (serving or current)[pool]) for pool in ("prefill", "decode")}
        verdicts = [self.guard.decide(pool, current[pool], getattr(grow, pool), getattr(hold, pool),
                                      violated[pool], traffic, now, starting[pool]) for pool in ("prefill", "decode")]
        return Decision(time=time.time(), dry_run=self.cfg.dry_run, connector=self.connector.name,
                        observed_rate=obs.rate, forecast_rate=fc.rate, hold_rate=fc.hold_rate, trend=fc.trend,
                        prompt_mean=fc.prompt_mean, output_mean=fc.output_mean, prefix_hit=fc.prefix_hit,
                        queued=obs.queued, slo_ttft=self.cfg.slo_ttft, slo_tpot=self.cfg.slo_tpot,
                        observed_ttft_p90=obs.ttft_p90, observed_tpot_p90=obs.tpot_p90, simulated_ttft_p90=grow.ttft_p90,
                        simulated_tpot_p90=grow.tpot_p90, feasible=grow.feasible, note=grow.note, pools=verdicts)

    async def run(self, stop: threading.Event) -> None:
        log.info("planner: every %g s, SLO TTFT %g s / TPOT %g s, pools prefill %d..%d decode %d..%d, connector %s%s",
                 self.cfg.interval_s, self.cfg.slo_ttft, self.cfg.slo_tpot, self.cfg.limits.min_prefill,
                 self.cfg.limits.max_prefill, self.cfg.limits.min_decode, self.cfg.limits.max_decode,
                 self.connector.name, " (dry run)" if self.cfg.dry_run else "")
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                await self.step()
                while not stop.is_set() and time.monotonic() - t0 < self.cfg.interval_s:
                    await asyncio.sleep(0.1)
        finally:
            if self.registry is not None:
                await self.registry.close()
