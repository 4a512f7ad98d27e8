"""The next interval's load from the last `window` observations: a moving window with a robust trend.

- Rate to grow for (`Forecast.rate`): level + max(0, trend) x horizon, where level = the last observed rate and
  trend = the (low) MEDIAN of the window's successive differences (per interval), counted only when at least 2/3
  of them are rises (a steady Poisson load's noise has positive median differences half the time, and
  extrapolating them adds a replica at a constant load). A ramp is led by its slope; a
  single step (one large difference among flat ones, or one of two: the low median of two is the smaller) has a
  median difference of 0, so it is followed at once without the overshoot a least-squares line fitted across the
  step would predict (which would add a replica and take it away again at a constant load: a flap).
- Rate a shrink must hold for (`Forecast.hold_rate`): the largest rate observed in the window. A pool shrinks only
  when every recent interval would have been served by fewer replicas - the hysteresis that keeps a noisy load
  from flapping a pool; together with the guard's scale-down cooldown.
- Lengths and prefix-hit ratio: request-weighted means over the window (intervals without requests carry none).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from pdserve.planner.scrape import Observation


@dataclass(frozen=True)
class Forecast:
    rate: float                 # req/s to be ready for next interval
    hold_rate: float            # req/s a smaller deployment would have to have served (window max)
    prompt_mean: float          # tokens
    output_mean: float
    prefix_hit: float           # 0..1
    trend: float                # req/s per interval (median successive difference)
    observed: float             # the last observed rate


class TrendPredictor:
    def __init__(self, window: int = 6, horizon: float = 1.0, default_prompt: float = 256.0,
                 default_output: float = 128.0):
        """`horizon`: how many intervals ahead to extrapolate the trend (the time a new replica needs to serve)."""
        if window < 2:
            raise ValueError("the predictor's window needs at least 2 intervals (a trend takes two points)")
        self.obs: deque[Observation] = deque(maxlen=window)
        self.horizon = horizon
        self.prompt, self.output = default_prompt, default_output

    def add(self, o: Observation) -> None:
        self.obs.append(o)

    def forecast(self) -> Forecast | None:
        if not self.obs:
            return None
        rates = [o.rate for o in self.obs]
        diffs = [b - a for a, b in zip(rates, rates[1:])]
        trend = statistics.median_low(diffs) if diffs else 0.0
        if sum(x > 0 for x in diffs) * 3 < 2 * len(diffs):  # a rise in fewer than 2/3 of the steps is noise
            trend = min(trend, 0.0)
        weighted = [o for o in self.obs if o.requests > 0 and o.prompt_mean is not None]
        w = sum(o.requests for o in weighted)
        if w > 0:  # lengths seen last stay the estimate through idle intervals
            self.prompt = sum(o.prompt_mean * o.requests for o in weighted) / w
            self.output = sum((o.output_mean or 0.0) * o.requests for o in weighted) / w
        hit = sum(o.prefix_hit * o.requests for o in weighted) / w if w > 0 else 0.0
        return Forecast(rate=max(0.0, rates[-1] + max(0.0, trend) * self.horizon), hold_rate=max(rates),
                        prompt_mean=self.prompt, output_mean=self.output, prefix_hit=hit, trend=trend,
                        observed=rates[-1])
