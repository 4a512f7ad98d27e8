"""Prefill and decode replica counts meeting the SLOs at the least GPU count: `pdserve sim plan`'s code
(pdserve/sim/plan.py, spec Q19) run on the forecast load with the live cost model.

For a rate R: one replica's capacity per pool under its SLO component from a simulated load sweep (`pool_rates`:
prefill vs TTFT, decode vs TPOT), the lower bound ceil(R x headroom / capacity) per pool, then the whole
disaggregated cluster simulated at R x headroom and grown / shrunk to the smallest that meets the target
attainment (`smallest_pd`). No N+1 here (`redundancy` 0): the planner reacts instead of provisioning for a failure
in advance. The simulated workload: Poisson arrivals at R, prompt lengths uniform over +-50% of the forecast mean
reduced by the measured prefix-hit ratio (the cached part costs no prefill), outputs likewise around their mean.

The count is bounded by the pool's min/max here; whether a pool may move that far this interval is the guard's.
A rate of 0 needs the minimum. If even the maximum cannot meet the SLO at R (or one replica cannot meet it at
any rate: the SLO is below one request's unloaded latency), the result says `feasible=False` and asks for the
maximum of the pool that fails: the best that can be done.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.engine.config import EngineConfig
from pdserve.planner.costs import LiveCosts
from pdserve.planner.guard import PoolLimits
from pdserve.sim.cluster import ClusterSpec
from pdserve.sim.plan import PlanInput, pool_rates, simulate, smallest_pd
from pdserve.sim.workload import SLO, LengthDist, synthetic


@dataclass(frozen=True)
class Sizing:
    prefill: int
    decode: int
    rate: float
    feasible: bool
    ttft_p90: float | None = None      # simulated at rate x headroom with these counts
    tpot_p90: float | None = None
    attainment: float | None = None
    prefill_capacity: float | None = None   # req/s one replica meets its SLO component at (capped at 2 x peak)
    decode_capacity: float | None = None
    note: str = ""


class Sizer:
    def __init__(self, slo: SLO, limits: PoolLimits, headroom: float = 1.2, attainment: float = 0.9,
                 requests: int = 200, sweep_requests: int = 100, seed: int = 0):
        self.slo, self.limits, self.headroom, self.attainment = slo, limits, headroom, attainment
        self.requests, self.sweep_requests, self.seed = requests, sweep_requests, seed
        self._memo: dict[tuple, Sizing] = {}

    def size(self, rate: float, prompt_mean: float, output_mean: float, prefix_hit: float,
             costs: LiveCosts) -> Sizing:
        lim = self.limits
        if rate <= 0:
            return Sizing(lim.min_prefill, lim.min_decode, 0.0, True, note="no load")
        prompt = max(1.0, prompt_mean * (1.0 - prefix_hit))
        # a cache key at ~2% resolution: the forecast moves a little every interval, the answer rarely does
        key = (_q(rate), _q(prompt), _q(output_mean), tuple(_q(v) for v in vars(costs.model).values()
                                                             if isinstance(v, float)), costs.num_blocks)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._size(rate, prompt, max(1.0, output_mean), costs)
            if len(self._memo) > 256:
                self._memo.pop(next(iter(self._memo)))
        return hit

    def _size(self, rate: float, prompt: float, output: float, costs: LiveCosts) -> Sizing:
        lim, slo = self.limits, self.slo
        pl = LengthDist("uniform", max(1, round(prompt * 0.5)), max(1, round(prompt * 1.5)))
        ol = LengthDist("uniform", max(1, round(output * 0.5)), max(1, round(output * 1.5)))

        def workload(r, n, seed):
            return synthetic(n, r, pl, ol, seed=seed)

        pi = PlanInput(rate=rate, slo=slo, workload=workload, cost=costs.model, num_blocks=costs.num_blocks,
                       engine=EngineConfig(max_num_seqs=costs.max_num_seqs), attainment=self.attainment,
                       peak_factor=self.headroom, redundancy=0, requests=self.requests,
                       sweep_requests=self.sweep_requests, modes=("disagg",), seed=self.seed)
        peak = rate * self.headroom
        # capacities beyond 2 x peak all mean "one replica is enough": the sweep stops there
        p_rate, d_rate = pool_rates(pi, cap=2 * peak)
        if p_rate <= 0 or d_rate <= 0:
            p = lim.max_prefill if p_rate <= 0 else lim.clamp("prefill", math.ceil(peak / p_rate))
            d = lim.max_decode if d_rate <= 0 else lim.clamp("decode", math.ceil(peak / d_rate))
            which = " and ".join(n for n, r in (("TTFT", p_rate), ("TPOT", d_rate)) if r <= 0)
            return Sizing(p, d, rate, False, prefill_capacity=p_rate, decode_capacity=d_rate,
                          note=f"one replica cannot meet the {which} SLO at any rate in simulation")
        p, d = max(1, math.ceil(peak / p_rate)), max(1, math.ceil(peak / d_rate))
        (p, d), s = smallest_pd(pi, p, d, peak, self.requests, lambda *_: None,
                                limit=lim.max_prefill + lim.max_decode + 1)
        pc, dc = lim.clamp("prefill", p), lim.clamp("decode", d)
        if (pc, dc) != (p, d):
            s = simulate(pi, ClusterSpec(prefill=pc, decode=dc), peak, self.requests, slo)
        att = s["slo"]["attainment_ratio"]
        lat = s["latency"]
        return Sizing(pc, dc, rate, att >= self.attainment, ttft_p90=lat["ttft_s"].get("p90"),
                      tpot_p90=lat["tpot_s"].get("p90"), attainment=att, prefill_capacity=p_rate,
                      decode_capacity=d_rate,
                      note="" if att >= self.attainment else f"the pool maxima meet the SLOs for {att:.0%} only")


def _q(x: float) -> float:
    """Round to ~2% (two significant digits in log scale)."""
    if x <= 0:
        return 0.0
    return round(math.log(x) / math.log(1.02))
