"""Prefill and decode replica counts meeting the SLOs, from the simulator (`pdserve sim plan`'s code, spec Q19)
run with the live cost model, and the simulated latency of the pools as they are.

Two kinds of simulation, kept apart because they cost very differently:
- **Capacities** (`Capacity`): one replica's highest rate under its SLO component, from simulated load sweeps
  (`pool_rates`: prefill vs TTFT with decode plentiful, decode vs TPOT with prefill plentiful): ~25 simulations,
  seconds to tens of seconds on a small CPU. They do not depend on the rate, only on the cost model, the lengths
  and the (corrected) SLO, so they are memoised on those (~5% resolution) and, in the loop, computed in the
  sizer's own background thread: an interval whose capacities are not ready uses the last ones (the decision says
  so) instead of running late. The sweep is capped at a power of two >= 4 x the peak rate it was asked for; a
  capacity at the cap means "at least the cap" and is recomputed with a higher cap once the peak reaches half.
- **The current pools** (`simulate_current`): the counts in place, at the observed rate and lengths: one cluster
  simulation (100 requests), memoised at ~5% of the rate. Its p90s are what the correction factors compare with
  the observed ones (correction.py).

Counts for a rate R: ceil(R x headroom / capacity) per pool, bounded by the pool's min/max (whether a pool may move
that far this interval is the guard's). A rate of 0 needs the minimum. One replica that cannot meet its SLO
component at any rate (the SLO is below one request's unloaded latency, as corrected) makes the result
`feasible=False` and asks for the pool's maximum: the best that can be done. The simulated workload: Poisson at
R, prompt lengths uniform over +-50% of the mean reduced by the measured prefix-hit ratio (the cached part costs
no prefill), outputs likewise around their mean.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pdserve.engine.config import EngineConfig
from pdserve.planner.costs import LiveCosts
from pdserve.planner.guard_rails import PoolLimits
from pdserve.sim.cluster import ClusterSpec
from pdserve.sim.plan import PlanInput, pool_rates, simulate
from pdserve.sim.workload import SLO, LengthDist, synthetic

log = logging.getLogger("pdserve.planner")


@dataclass(frozen=True)
class Capacity:
    prefill: float              # req/s one prefill replica meets the TTFT SLO at (0: at no rate)
    decode: float
    cap: float                  # the sweep's ceiling: a capacity near it means "at least"
    seconds: float              # what the sweep cost
    lengths: tuple[float, float] | None = None  # the (prompt, output) tokens it was computed for

    def capped(self, x: float) -> bool:
        return x >= 0.95 * self.cap


@dataclass(frozen=True)
class Sizing:
    prefill: int
    decode: int
    rate: float
    feasible: bool
    prefill_capacity: float | None = None
    decode_capacity: float | None = None
    stale: bool = False          # the capacities of older inputs (the current ones are being computed)
    note: str = ""
    lengths: tuple[float, float] | None = None  # the (prompt, output) tokens the capacities were computed for


@dataclass(frozen=True)
class Workload:
    """The lengths the simulations use (the prompt already reduced by the prefix-hit ratio)."""
    prompt: float
    output: float

    @classmethod
    def of(cls, prompt_mean: float, output_mean: float, prefix_hit: float) -> "Workload":
        return cls(max(1.0, prompt_mean * (1.0 - prefix_hit)), max(1.0, output_mean))

    def requests(self, rate: float, n: int, seed: int):
        pl = LengthDist("uniform", max(1, round(self.prompt * 0.5)), max(1, round(self.prompt * 1.5)))
        ol = LengthDist("uniform", max(1, round(self.output * 0.5)), max(1, round(self.output * 1.5)))
        return synthetic(n, rate, pl, ol, seed=seed)


class Sizer:
    def __init__(self, limits: PoolLimits, headroom: float = 1.2, attainment: float = 0.9,
                 requests: int = 100, sweep_requests: int = 100, seed: int = 0, background: bool = True):
        """`requests`: simulated requests of the current pools (its p90 is smoothed by the correction's EWMA, and
        it runs on the loop's time: ~0.3 s at 100 on a 2-core EPYC); `background`: capacities computed in the
        sizer's own thread (the loop); False: inline (tests)."""
        self.limits, self.headroom, self.attainment = limits, headroom, attainment
        self.requests, self.sweep_requests, self.seed = requests, sweep_requests, seed
        self._caps: dict[tuple, Capacity] = {}
        self._latest: Capacity | None = None
        self._sims: dict[tuple, tuple[float | None, float | None]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="planner-sizer") if background else None
        self._pending: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop: a sweep in progress ends at its next simulation (its workload raises), not at its end."""
        self._closed.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _workload(self, wl: Workload):
        def make(rate: float, n: int, seed: int):
            if self._closed.is_set():
                raise _Closed()
            return wl.requests(rate, n, seed)
        return make

    def _input(self, rate: float, wl: Workload, costs: LiveCosts, slo: SLO) -> PlanInput:
        return PlanInput(rate=rate, slo=slo, workload=self._workload(wl), cost=costs.model,
                         num_blocks=costs.num_blocks, engine=EngineConfig(max_num_seqs=costs.max_num_seqs),
                         attainment=self.attainment, peak_factor=self.headroom, redundancy=0,
                         requests=self.requests, sweep_requests=self.sweep_requests, modes=("disagg",),
                         seed=self.seed)

    def _sweep(self, key: tuple, cap: float, wl: Workload, costs: LiveCosts, slo: SLO) -> Capacity | None:
        t0 = time.monotonic()
        try:
            # the sweep starts at cap / 64 (PlanInput.rate / 64) and doubles up to the cap
            p, d = pool_rates(self._input(cap, wl, costs, slo), cap=cap)
        except _Closed:
            return None
        finally:
            with self._lock:
                self._pending.pop(key, None)
        c = Capacity(p, d, cap, time.monotonic() - t0, (wl.prompt, wl.output))
        with self._lock:
            self._caps[key] = self._latest = c
            if len(self._caps) > 64:
                self._caps.pop(next(iter(self._caps)))
        log.debug("planner: capacities prefill %.3g req/s, decode %.3g req/s (cap %g) in %.1f s", p, d, cap,
                  c.seconds)
        return c

    def capacity(self, peak: float, wl: Workload, costs: LiveCosts, slo: SLO) -> tuple[Capacity | None, bool]:
        """The capacities for these inputs; (the last ones computed, True) while they are being computed."""
        # ~5% resolution: the correction (5% dead band) and the smoothed costs (10%) move in steps about that size,
        # and a sweep per small move would keep the capacities forever a step behind
        key = (_q(wl.prompt), _q(wl.output), _q(slo.ttft, 1.05), _q(slo.tpot, 1.05), costs.num_blocks,
               costs.max_num_seqs, tuple(_q(v, 1.05) for v in vars(costs.model).values() if isinstance(v, float)))
        with self._lock:
            hit = self._caps.get(key)
            if hit is not None and (2 * peak <= hit.cap or not (hit.capped(hit.prefill) or hit.capped(hit.decode))):
                return hit, False
            cap = 2.0 ** math.ceil(math.log2(max(8.0, 4 * peak)))
            if self._pool is not None:
                if key not in self._pending:
                    self._pending[key] = self._pool.submit(self._sweep, key, cap, wl, costs, slo)
                return self._latest, True
        return self._sweep(key, cap, wl, costs, slo), False

    def size(self, rate: float, wl: Workload, costs: LiveCosts, slo: SLO) -> Sizing | None:
        """Counts for `rate` x headroom; None when no capacities were computed yet."""
        lim = self.limits
        if rate <= 0:
            return Sizing(lim.min_prefill, lim.min_decode, 0.0, True, note="no load")
        peak = rate * self.headroom
        cap, stale = self.capacity(peak, wl, costs, slo)
        if cap is None:
            return None
        counts, bad = {}, []
        for pool, c in (("prefill", cap.prefill), ("decode", cap.decode)):
            if c <= 0:
                counts[pool] = getattr(lim, f"max_{pool}")
                bad.append("TTFT" if pool == "prefill" else "TPOT")
            elif cap.capped(c) and peak <= cap.cap:
                counts[pool] = lim.clamp(pool, 1)
            else:
                counts[pool] = lim.clamp(pool, math.ceil(peak / c - 1e-9))
        note = f"one replica cannot meet the {' and '.join(bad)} SLO at any rate in simulation" if bad else ""
        return Sizing(counts["prefill"], counts["decode"], rate, not bad, cap.prefill, cap.decode, stale, note,
                      cap.lengths)

    def simulate_current(self, prefill: int, decode: int, rate: float, wl: Workload,
                         costs: LiveCosts) -> tuple[float | None, float | None]:
        """Simulated (TTFT p90, TPOT p90) of these counts at `rate` (memoised at ~5% of the rate)."""
        if rate <= 0 or prefill < 1 or decode < 1:
            return None, None
        key = (prefill, decode, _q(rate, 1.05), _q(wl.prompt), _q(wl.output), costs.num_blocks,
               tuple(_q(v) for v in vars(costs.model).values() if isinstance(v, float)))
        hit = self._sims.get(key)
        if hit is None:
            pi = self._input(rate, wl, costs, SLO())
            lat = simulate(pi, ClusterSpec(prefill=prefill, decode=decode), rate, self.requests, SLO())["latency"]
            hit = self._sims[key] = (lat["ttft_s"].get("p90"), lat["tpot_s"].get("p90"))
            if len(self._sims) > 256:
                self._sims.pop(next(iter(self._sims)))
        return hit


class _Closed(Exception):
    """The sizer was closed while a sweep ran."""


def _q(x: float | None, base: float = 1.02) -> float | None:
    """Round to ~2% (log scale)."""
    if x is None or x <= 0:
        return None if x is None else 0.0
    return round(math.log(x) / math.log(base))
