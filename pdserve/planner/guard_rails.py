"""Guard rails between what the model asks for and what a pool is told, one pool at a time.

In order:
1. direction: grow to the count the forecast rate needs when that is more than now - once `confirm`
   consecutive intervals asked for more (one interval's burst of a steady Poisson load is not a new level); shrink
   to the count the window's largest rate needs when that is less (predictor.py: the hysteresis); otherwise stay;
2. feedback: when the pool's own SLO component is violated as measured (TTFT p90 for prefill, TPOT p90 for decode)
   in `confirm` consecutive intervals and the model still says "enough", grow by one anyway: the measurement beats the model (the simulator is a lower
   bound for a deployment: docs/sim.md) - unless a replica of the pool is still starting (counted, not registered):
   the latency measured then is the pool before the change took effect (spec §1.5: a cold start is not the steady
   state), and growing again on it would run the pool to its maximum while one worker loads;
3. min/max of the pool, and never below one replica while the deployment serves traffic;
4. at most one step per interval, unless the pool's SLO is violated (then straight to the model's count);
5. no shrink on a model not yet checked against the counts in place (the correction learned from fewer than its
   minimum of intervals since they last changed: correction.py), nor on capacities computed for older inputs
   (the corrected SLO or the costs moved since; sizing.py), nor within `cooldown_s` of the pool's last change
   (either way). Growing on them is allowed: too many replicas for a while cost less than too few.

Rule 5 is for drains. Which worker a grow may take from the other pool by role switch instead (no capacity leaves
the deployment) is switching.py's and surplus.py's, on what the pools measure now; the cooldown holds it too.
"""
from __future__ import annotations

from dataclasses import dataclass


# Here rather than in sizing.py (which sizes by simulation: torch, the simulator): decision.py, and through it
# `pdserve status` and `up`'s state file, need only these bounds, and importing policy cost them ~2 s a start.
@dataclass(frozen=True)
class PoolLimits:
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4

    def clamp(self, pool: str, n: int) -> int:
        lo, hi = (self.min_prefill, self.max_prefill) if pool == "prefill" else (self.min_decode, self.max_decode)
        return min(hi, max(lo, n))


@dataclass(frozen=True)
class PoolVerdict:
    pool: str
    current: int
    desired: int
    reason: str
    switch_to: str = ""  # the pool its workers move to by role switch (switching.py), instead of draining

    @property
    def action(self) -> str:
        if self.desired < self.current and self.switch_to:
            return "switch"
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


class Guard:
    def __init__(self, limits: PoolLimits, cooldown_s: float = 60.0, confirm: int = 1):
        self.limits = limits
        self.cooldown_s = cooldown_s
        self.confirm = confirm
        self.last_change: dict[str, float] = {}
        self.asked: dict[str, int] = {}  # consecutive intervals whose forecast needed more than the pool had
        self.violations: dict[str, int] = {}  # consecutive intervals whose measured SLO component was violated

    def decide(self, pool: str, current: int, grow_to: int, shrink_to: int, violated: str | None, traffic: bool,
               now: float, starting: int = 0, checked: bool = True, stale: bool = False,
               measured: bool = True) -> PoolVerdict:
        """`grow_to`: count for the forecast rate; `shrink_to`: count for the window's largest rate; `violated`:
        a description of the measured SLO violation of this pool, or None; `starting`: replicas counted but not
        serving yet; `checked`: the model was compared with the counts in place (correction.py) - no shrink on a
        model not yet checked against them; `stale`: the shrink count came from capacities of older inputs (the
        current ones are being computed) - no shrink on those either; `measured`: the interval had the pool's SLO
        component to judge (a request finished in it) - an interval without one neither confirms nor resets a
        violation streak: nothing finishing is no evidence that the SLO is met (800-token prompts at a 4.7 s TTFT,
        3 clients, left every other 2 s interval without a finished request, and the violation was confirmed only
        after 4-6 intervals instead of 2)."""
        if violated and starting > 0:
            violated, waiting = None, f"{violated}, but {starting} replica(s) still starting"
        else:
            waiting = None
        if measured or violated:
            self.violations[pool] = self.violations.get(pool, 0) + 1 if violated else 0
        if violated and self.violations[pool] < self.confirm:  # one interval's p90 of a few dozen requests is noisy
            violated, waiting = None, f"{violated} ({self.violations[pool]} of {self.confirm} intervals to confirm)"
        self.asked[pool] = self.asked.get(pool, 0) + 1 if grow_to > current else 0
        if grow_to > current and self.asked[pool] < self.confirm and not violated:
            want, why = current, (f"forecast needs {grow_to} ({self.asked[pool]} of {self.confirm} consecutive "
                                  "intervals to confirm)")
        elif grow_to > current:
            want, why = grow_to, f"forecast needs {grow_to}"
        elif shrink_to < current:
            want, why = shrink_to, f"every recent interval needed at most {shrink_to}"
        else:
            want, why = current, f"forecast needs {grow_to}"
        if violated and want <= current:
            want, why = current + 1, f"{violated} while the model says {max(grow_to, shrink_to)} suffice"
        elif violated:
            why += f"; {violated}"
        if waiting:
            why += f"; {waiting}"
        lo = self.limits.min_prefill if pool == "prefill" else self.limits.min_decode
        hi = self.limits.max_prefill if pool == "prefill" else self.limits.max_decode
        floor = max(lo, 1) if traffic else lo
        bounded = min(hi, max(floor, want))
        if bounded != want:
            why += f"; bounded to {bounded} (min {floor}, max {hi})"
        want = bounded
        if want > current + 1 and not violated:
            want, why = current + 1, why + "; one step per interval"
        elif want < current - 1:
            want, why = current - 1, why + "; one step per interval"
        if want < current and not checked:
            want, why = current, why + "; the model is not yet checked against these counts"
        elif want < current and stale:
            want, why = current, why + "; no shrink on the last capacities (the current ones are being computed)"
        if want < current:
            since = now - self.last_change.get(pool, -1e18)
            if since < self.cooldown_s:
                want, why = current, why + f"; scale-down cooldown ({self.cooldown_s - since:.0f} s left)"
        return PoolVerdict(pool, current, want, why)

    def applied(self, pool: str, now: float) -> None:
        self.last_change[pool] = now
        self.asked[pool] = self.violations[pool] = 0  # what asked for the change is answered: confirm afresh
