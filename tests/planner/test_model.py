"""The planner's model against what it observes, with synthetic observations (no simulator, no processes).

The "deployment" here is an analytic one: one decode replica's TPOT p90 at a per-replica rate x is
TRUE x (A + B x), TTFT likewise, observed with seeded noise; the planner's "simulator" (a stand-in for the Sizer)
knows only A + B x, i.e. it is wrong by the factor TRUE, as the real simulator is for a real deployment (it has
no front end, no host noise). The counts each SLO needs are hand-computed from the same formula: the planner must
find them through its correction factor, hold them under a constant load, and follow a 2 -> 8 req/s step.
"""
from __future__ import annotations

import asyncio
import math
import random
import statistics
import threading
import time

import pytest

from pdserve.planner import sizing
from pdserve.planner.correction import Correction, Factor
from pdserve.planner.costs import CostSmoother, LiveCosts
from pdserve.planner.guard_rails import PoolLimits
from pdserve.planner.loop import Planner, PlannerConfig
from pdserve.planner.scrape import Observation
from pdserve.planner.sizing import Sizer, Sizing, Workload
from pdserve.sim.costmodel import LinearCostModel

A, B = 0.004, 0.0015        # simulated TPOT p90 of one decode replica at x req/s: A + B x
TA, TB = 0.010, 0.001       # simulated TTFT p90 of one prefill replica: TA + TB x (never the limit here)
TRUE = 2.0                  # the deployment is this much slower than the model
SLO_TTFT, SLO_TPOT = 0.5, 0.03
INTERVAL = 5.0
COSTS = LiveCosts(LinearCostModel(), 256, 64, ())


def needed(rate: float, slo_tpot: float, factor: float, headroom: float = 1.2) -> int:
    """Hand-computed decode count: the per-replica rate x at which factor x (A + B x) = slo."""
    return math.ceil(rate * headroom / ((slo_tpot / factor - A) / B))


class AnalyticSizer:
    """The Sizer's interface on the analytic model (capacities in closed form)."""

    def __init__(self, limits: PoolLimits, headroom: float = 1.2):
        self.limits, self.headroom = limits, headroom

    def simulate_current(self, prefill, decode, rate, wl, costs):
        if rate <= 0:  # as the Sizer: no arrivals, nothing to simulate
            return None, None
        return TA + TB * rate / prefill, A + B * rate / decode

    def size(self, rate, wl, costs, slo):
        if rate <= 0:
            return Sizing(self.limits.min_prefill, self.limits.min_decode, 0.0, True)
        p_cap, d_cap = (slo.ttft - TA) / TB, (slo.tpot - A) / B
        peak = rate * self.headroom
        return Sizing(self.limits.clamp("prefill", math.ceil(peak / p_cap)),
                      self.limits.clamp("decode", math.ceil(peak / d_cap)), rate, True, p_cap, d_cap)

    def close(self):
        pass


class Pools:
    name = "test"

    def __init__(self):
        self.n = {"prefill": 1, "decode": 1}

    def replicas(self):
        return dict(self.n)


def planner(correct: bool = True, window: int = 6, cooldown_intervals: float = 2) -> tuple[Planner, Pools]:
    limits = PoolLimits(1, 2, 1, 4)
    cfg = PlannerConfig(redis_url="redis://127.0.0.1:1/0", model="m", interval_s=INTERVAL, slo_ttft=SLO_TTFT,
                        slo_tpot=SLO_TPOT, limits=limits, cooldown_s=cooldown_intervals * INTERVAL, window=window,
                        background=False)
    pools = Pools()
    p = Planner(cfg, pools, lambda: [])
    p.sizer = AnalyticSizer(limits)
    if not correct:
        p.correction.ttft = Factor(alpha=0.0)   # never learns: the raw simulation
        p.correction.tpot = Factor(alpha=0.0)
        p.correction.min_requests = math.inf
        p.correction.tpot.min_samples = 0       # and the guard takes it as checked
    return p, pools


def drive(p: Planner, pools: Pools, rates: list[float], seed: int = 0, noise: float = 0.15):
    """Each interval: the deployment (TRUE x the model, noisy) is observed at the counts in place; the planner's
    changes are applied, as a connector would."""
    rng = random.Random(seed)
    hist = []
    for i, rate in enumerate(rates):
        r = max(0.0, rng.gauss(rate, rate * 0.16))   # one interval's Poisson count at ~8 req/s x 5 s
        n = rate * INTERVAL
        tpot = TRUE * (A + B * r / pools.n["decode"]) * math.exp(rng.gauss(0, noise))
        ttft = TRUE * (TA + TB * r / pools.n["prefill"]) * math.exp(rng.gauss(0, noise))
        obs = Observation(window_s=INTERVAL, rate=r, requests=n, prompt_mean=32, output_mean=96, prefix_hit=0.0,
                          ttft_p90=ttft, tpot_p90=tpot, queued=0)
        d = p.decide(obs, COSTS, pools.replicas(), i * INTERVAL)
        for v in d.pools:
            if v.action != "hold":
                pools.n[v.pool] = v.desired
                p.guard.applied(v.pool, i * INTERVAL)
        hist.append((rate, dict(pools.n), d))
    return hist


def changes(hist, pool="decode") -> list[tuple[int, int]]:
    out, prev = [], 1
    for i, (_, n, _) in enumerate(hist):
        if n[pool] != prev:
            out.append((i, n[pool]))
            prev = n[pool]
    return out


def test_hand_computed_counts():
    # the scenario's premise, from the formula alone: the raw model thinks one replica serves 8 req/s, the
    # deployment needs two; 2 req/s needs one either way
    assert needed(8, SLO_TPOT, 1.0) == 1 and needed(8, SLO_TPOT, TRUE) == 2
    assert needed(2, SLO_TPOT, TRUE) == 1


@pytest.mark.parametrize("seed", range(5))
def test_constant_load_corrected_model_agrees_and_holds(seed):
    p, pools = planner()
    hist = drive(p, pools, [8.0] * 30, seed=seed)
    # the correction converged to the deployment's factor (an EWMA of noisy log ratios: within 15%)
    assert abs(p.correction.tpot.applied / TRUE - 1) < 0.15, p.correction.tpot
    # after warm-up, corrected simulated / observed p90: its median within 10%, >= 70% of the intervals within the
    # 25% band (the observation's own noise is 15%, so some fall outside); the raw simulation is never inside it
    late = [d for _, _, d in hist[8:]]
    ratios = [d.corrected_tpot_p90 / d.observed_tpot_p90 for d in late]
    assert abs(statistics.median(ratios) - 1) < 0.1, ratios
    assert sum(abs(x - 1) <= 0.25 for x in ratios) >= 0.7 * len(ratios), ratios
    assert statistics.median(d.simulated_tpot_p90 / d.observed_tpot_p90 for d in late) < 0.6
    # the pool reaches the hand-computed count and changes once: no flip-flop
    assert hist[-1][1]["decode"] == needed(8, SLO_TPOT, TRUE) == 2
    assert len(changes(hist)) <= 2 and changes(hist)[-1][1] == 2, changes(hist)
    assert all(b >= a for (_, a), (_, b) in zip([(0, 1)] + changes(hist), changes(hist))), changes(hist)
    # every decision says what it compared and what it applied
    line = hist[-1][2].line()
    assert "p90 observed" in line and "x correction" in line and "simulated" in line


def test_raw_model_flip_flops_where_the_corrected_one_holds():
    """The test can fail: without the correction, the measured-violation rule and the raw model disagree, and
    the decode pool goes 1 -> 2 -> 1 -> 2 at a constant load."""
    p, pools = planner(correct=False)
    hist = drive(p, pools, [8.0] * 40, seed=1)
    assert len(changes(hist)) >= 3, changes(hist)


def test_step_2_to_8_acted_on_within_three_intervals():
    p, pools = planner()
    rates = [2.0] * 10 + [8.0] * 12
    hist = drive(p, pools, rates, seed=3)
    assert all(n["decode"] == 1 for _, n, _ in hist[:10])
    grew = next(i for i, (_, n, _) in enumerate(hist) if n["decode"] == 2)
    assert 10 <= grew <= 12, changes(hist)
    assert changes(hist) == [(grew, 2)]


def test_correction_learns_only_from_steady_well_populated_intervals():
    c = Correction.default()
    assert not c.observe(100, (0.1, 0.02), (0.05, 0.01), steady=False)  # the counts changed in the interval
    assert not c.observe(3, (0.1, 0.02), (0.05, 0.01), steady=True)     # too few requests
    assert c.tpot.samples == 0 and c.checked_at_current()   # nothing to check it on: a shrink is not blocked
    # x2, x2, then x2: applied once three intervals agree (a running mean of the logs: exactly 2)
    assert not c.observe(100, (0.1, 0.02), (0.05, 0.01), steady=True)
    assert not c.checked_at_current()                         # under load, one interval is not a check
    assert not c.observe(100, (0.1, 0.02), (0.05, 0.01), steady=True)
    assert c.observe(100, (0.1, 0.02), (0.05, 0.01), steady=True)
    assert c.tpot.applied == pytest.approx(2.0) and c.ttft.applied == pytest.approx(2.0)
    assert c.checked_at_current()
    c.observe(100, (0.4, 0.08), (0.05, 0.01), steady=False)             # a change: ignored, and unchecked
    assert c.tpot.applied == pytest.approx(2.0) and not c.checked_at_current()
    c.observe(0, (None, None), (None, None), steady=True)               # no load: nothing to check it on
    assert c.checked_at_current() and c.checked == 0
    # past 1/alpha samples an EWMA in log space: x8 once moves log2 by alpha x (3 - 1)
    for _ in range(3):  # past 1/alpha samples
        c.observe(100, (0.1, 0.02), (0.05, 0.01), steady=True)
    before = math.log2(c.tpot.smoothed)
    c.observe(100, (0.4, 0.08), (0.05, 0.01), steady=True)
    assert math.log2(c.tpot.smoothed) == pytest.approx(before + c.tpot.alpha * (3 - before))
    assert c.slo(0.5, 0.05) == pytest.approx((0.5 / c.ttft.applied, 0.05 / c.tpot.applied))


def test_correction_dead_band_and_bound():
    f = Factor(min_samples=1)
    f.update(0.02, 0.01)
    assert f.applied == pytest.approx(2.0)
    assert not f.update(0.021, 0.01)        # smoothed 2.05: inside the 5% band, applied stays
    assert f.applied == pytest.approx(2.0)
    g = Factor(min_samples=1)
    g.update(100.0, 0.01)                   # a stalled worker: clamped to the bound
    assert g.applied == pytest.approx(8.0)


def _costs(a: float, c: float = 0.001) -> LiveCosts:
    return LiveCosts(LinearCostModel(a=a, c=c), 256, 64, ("a", "c"))


def test_cost_smoother_ignores_one_slow_step_and_follows_a_real_change():
    s = CostSmoother(window=5, deadband=0.1)
    seq = (0.005, 0.0051, 0.0049, 0.005, 0.015, 0.005, 0.0051, 0.0049, 0.005, 0.0051)
    used = [s.smooth(_costs(a)).model.a for a in seq]
    assert used == [0.005] * 10             # one heartbeat 3x slow (an outlier-clipped step): no move
    moved = [s.smooth(_costs(0.008)).model.a for _ in range(4)]
    # the median of five moves once three of them are new; then the dead band holds it
    assert moved[:2] == [0.005, 0.005] and moved[2] == pytest.approx(0.008) and moved[3] == pytest.approx(0.008)
    # fields nobody measured keep the base model's value untouched
    assert s.smooth(LiveCosts(LinearCostModel(a=0.3), 256, 64, ())).model.a == 0.3


def test_background_sizer_keeps_the_decision_on_time(monkeypatch):
    """A capacity sweep slower than an interval runs in the sizer's thread: decisions meanwhile are arithmetic
    on the last capacities (or a hold with a note before the first), taken at once."""
    release = threading.Event()
    calls = []

    def slow_pool_rates(pi, cap):
        calls.append(cap)
        release.wait(10)
        return 4.0, 3.0

    monkeypatch.setattr(sizing, "pool_rates", slow_pool_rates)
    sz = Sizer(PoolLimits(1, 4, 1, 4), background=True)
    from pdserve.sim.workload import SLO
    wl, slo = Workload.of(32, 96, 0.0), SLO(ttft=0.5, tpot=0.05)
    t0 = time.monotonic()
    assert sz.size(2.0, wl, COSTS, slo) is None          # nothing computed yet: the caller holds
    assert sz.size(2.0, wl, COSTS, slo) is None          # still computing: not submitted twice
    assert time.monotonic() - t0 < 0.5 and calls == [16.0]
    release.set()
    deadline = time.monotonic() + 5
    while sz.size(2.0, wl, COSTS, slo) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    s = sz.size(2.0, wl, COSTS, slo)
    assert (s.prefill, s.decode, s.stale) == (1, 1, False)
    # other inputs (a new cost model): sized at once on the last capacities, marked stale
    release.clear()
    s = sz.size(8.0, wl, _costs(0.02), slo)
    assert s.stale and (s.prefill, s.decode) == (math.ceil(9.6 / 4.0), math.ceil(9.6 / 3.0))
    release.set()
    sz.close()


def test_loop_keeps_its_schedule_and_exports_its_time(monkeypatch):
    from pdserve.services.metrics import planner as M
    p, _ = planner()
    p.cfg = PlannerConfig(**{**vars(p.cfg), "interval_s": 0.2})
    starts = []

    async def step():
        starts.append(time.monotonic())
        await asyncio.sleep(0.08 if len(starts) % 2 else 0.01)   # uneven step times
    monkeypatch.setattr(p, "step", step)
    stop = threading.Event()
    threading.Timer(1.05, stop.set).start()
    asyncio.run(p.run(stop))
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 5 and all(abs(g - 0.2) < 0.06 for g in gaps), gaps   # not interval + step time
    assert M.STEP_SECONDS is not None and M.OVERRUNS is not None


def test_closing_the_sizer_ends_a_running_sweep_at_its_next_simulation(monkeypatch):
    started = threading.Event()

    def endless_pool_rates(pi, cap):   # a sweep of many simulations, each asking for its workload
        while True:
            pi.workload(1.0, 10, 0)
            started.set()
            time.sleep(0.05)

    monkeypatch.setattr(sizing, "pool_rates", endless_pool_rates)
    sz = Sizer(PoolLimits(1, 4, 1, 4), background=True)
    from pdserve.sim.workload import SLO
    assert sz.size(2.0, Workload.of(32, 96, 0.0), COSTS, SLO(ttft=0.5, tpot=0.05)) is None
    assert started.wait(5)
    t0 = time.monotonic()
    sz.close()
    assert time.monotonic() - t0 < 1.0


def test_model_is_compared_with_the_observation_pooled_over_steady_intervals():
    p, pools = planner()
    asked = []

    def pooled(k):
        asked.append(k)
        return Observation(window_s=k * INTERVAL, rate=8.0, requests=40 * k, prompt_mean=32, output_mean=96,
                           prefix_hit=0.0, ttft_p90=0.1, tpot_p90=0.07, queued=0)

    one = Observation(window_s=INTERVAL, rate=8.0, requests=40, prompt_mean=32, output_mean=96, prefix_hit=0.0,
                      ttft_p90=0.05, tpot_p90=0.02, queued=0)
    spans, seen = [], []
    for i in range(6):
        counts = {"prefill": 1, "decode": 1 if i < 4 else 2}   # a change before interval 4
        d = p.decide(one, COSTS, counts, i * INTERVAL, pooled=pooled)
        spans.append(d.compared_intervals)
        seen.append(d.compared_tpot_p90)
    # the first interval has no predecessor and the one after the change mixes two deployments: 1 interval; then
    # the pool grows with the run of intervals at the same counts, up to 3
    assert spans == [1, 1, 2, 3, 1, 1] and asked == [2, 3]
    assert seen == [0.02, 0.02, 0.07, 0.07, 0.02, 0.02]
    # and the correction learned from what was compared, in every steady interval (not the one after the change):
    # the running mean of log(observed / simulated) - 0.02 and 0.07 against A + B x 8, then 0.02 against A + B x 4
    assert p.correction.tpot.samples == 4
    r1, r7, r2 = 0.02 / (A + B * 8), 0.07 / (A + B * 8), 0.02 / (A + B * 4)
    x = math.log(r1)
    for n, r in ((2, r7), (3, r7), (4, r2)):
        w = max(p.correction.tpot.alpha, 1 / n)
        x = (1 - w) * x + w * math.log(r)
    assert p.correction.tpot.smoothed == pytest.approx(math.exp(x))


def test_every_line_states_the_correction_even_with_nothing_simulated():
    p, pools = planner()
    idle = Observation(window_s=INTERVAL, rate=0.0, requests=0, prompt_mean=None, output_mean=None, prefix_hit=0.0,
                       ttft_p90=None, tpot_p90=None, queued=0)
    line = p.decide(idle, COSTS, pools.replicas(), 0.0).line()
    assert line.count("(nothing to simulate) x correction 1.00") == 2 and "p90 observed -" in line
