"""Correction factors: how far the simulator is from the deployment it plans, learned from observation.

Each interval the planner simulates the pools as they are (current counts, the observed rate and lengths) and
compares the simulated TTFT / TPOT p90 with the observed ones. The ratio observed / simulated is the correction
(as Dynamo's planner applies to its interpolator): the sizing then asks the simulator to meet SLO / correction,
i.e. the simulated latency times the correction must meet the SLO.

- Smoothed: an EWMA of log(ratio) (`alpha`; a running mean over the first 1/alpha samples), so one noisy interval
  moves the factor by at most a fraction of its error, and doubling and halving weigh alike.
- Learned only from intervals that say something: at least `min_requests` finished (a p90 of a handful of
  requests is noise) and the pools steady (no replica starting, the same serving counts as at the last decision:
  otherwise the observation mixes two deployments while the simulation has one).
- Clamped to [1/`bound`, `bound`]: a ratio beyond it is a fault (a stalled worker), not a model error.
- Applied once `min_samples` intervals were learned from (one interval's ratio carries that interval's noise at
  full weight), and then with a dead band: the factor the sizing uses moves only when the smoothed one is more than `deadband`
  away from it (relative), so the sizing's inputs - and its memo - stay put at a steady load.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Factor:
    """One SLO component's correction."""
    alpha: float = 0.4
    bound: float = 8.0
    deadband: float = 0.05
    min_samples: int = 3
    log_smoothed: float | None = None
    applied: float = 1.0
    samples: int = 0

    @property
    def smoothed(self) -> float:
        return 1.0 if self.log_smoothed is None else math.exp(self.log_smoothed)

    def update(self, observed: float | None, simulated: float | None) -> bool:
        """Learn from one interval's pair; True when the applied factor moved."""
        if not observed or not simulated or observed <= 0 or simulated <= 0:
            return False
        x = max(-math.log(self.bound), min(math.log(self.bound), math.log(observed / simulated)))
        self.samples += 1
        # a running mean until 1/alpha samples (an EWMA started on its first sample would carry that one's noise
        # at full weight), then the EWMA
        w = max(self.alpha, 1.0 / self.samples)
        self.log_smoothed = x if self.log_smoothed is None else (1 - w) * self.log_smoothed + w * x
        s = self.smoothed
        if self.samples >= self.min_samples and abs(s / self.applied - 1.0) > self.deadband:
            self.applied = s
            return True
        return False


@dataclass
class Correction:
    ttft: Factor
    tpot: Factor
    min_requests: float = 8.0
    checked: int = 0                # intervals learned from since the serving counts last changed
    idle: bool = False              # the last interval had too few requests to compare anything on

    def checked_at_current(self) -> bool:
        """The model was compared with these counts in enough intervals (`Factor.min_samples`) to act on it - or
        there is no load to compare it on (then nothing is at stake in a shrink: a pool idles down)."""
        return self.idle or self.checked >= self.tpot.min_samples

    @classmethod
    def default(cls) -> "Correction":
        return cls(Factor(), Factor())

    def observe(self, requests: float, observed: tuple[float | None, float | None],
                simulated: tuple[float | None, float | None], steady: bool) -> bool:
        """One interval: `observed` / `simulated` = (TTFT p90, TPOT p90) at the current counts; `steady`: no
        replica starting, the same serving counts through the interval. True when an applied factor moved."""
        if not steady:
            self.checked = 0
        self.idle = requests < self.min_requests or observed == (None, None)
        if not steady or requests < self.min_requests:
            return False
        self.checked += 1
        moved = self.ttft.update(observed[0], simulated[0])
        return self.tpot.update(observed[1], simulated[1]) or moved

    def slo(self, ttft: float, tpot: float) -> tuple[float, float]:
        """The SLO the simulator must meet so that the deployment meets (ttft, tpot)."""
        return ttft / self.ttft.applied, tpot / self.tpot.applied
