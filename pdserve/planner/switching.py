"""Switch a worker's role instead of starting one and draining another, when one pool must grow while the other
may shrink.

A switch (services/role_switch.py) takes a fraction of a second plus the old role's drain, in the same process with
its weights loaded; a new worker takes its load and warm-up (seconds here, minutes for a pod pulling an image and
weights). So when the guard rails (guard_rails.py) let one pool grow by `a` and the other shrink by `b`, min(a, b)
workers move from the shrinking pool to the growing one, and only the rest is started or drained. A connector
that cannot switch (`switch` absent) scales as before.

Whether a switch pays (`SwitchCosts`): the growing pool gets the switched worker once its old role has drained and
the switch is done (drain + `switch_s`); a new worker serves `start_s` after it was asked for, while the old one
drains beside it. So workers switch when the source pool's expected drain + `switch_s` < `start_s`, and are
started (and the source pool drained) otherwise - e.g. decode streams of thousands of tokens against a pod that
starts in seconds. Expected drains (`drain_estimate`): a prefill worker holds prompts for about their TTFT (its
queue and the pinned KV until the decode side pulls it); a decode worker its streams, at most an output's length
at the TPOT SLO - or, handing them to the gateway's migration (handoff `migrate`), one more token each.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from pdserve.planner.guard_rails import PoolVerdict

# bench/role_switch.py on the built-in model: SwitchRole arrival -> registered in the new role, 0.31-0.70 s
# (median 0.48 s) including a drain of one stream (docs/planner.md).
SWITCH_S = 0.5


@dataclass(frozen=True)
class SwitchCosts:
    switch_s: float = SWITCH_S            # the switch's own time after the drain
    start_s: float = 30.0                 # a new worker: asked for -> serving (process start or pod schedule,
                                          # image, weights, warm-up)
    drain_s: dict = field(default_factory=dict)  # expected drain of a worker leaving each pool, seconds

    def switch_pays(self, src: str) -> bool:
        return self.drain_s.get(src, 0.0) + self.switch_s < self.start_s


def drain_estimate(output_mean: float, slo_ttft: float, slo_tpot: float, handoff: str = "drain"
                   ) -> dict[str, float]:
    """Expected drain per pool (module docstring): prefill ~ a TTFT, decode ~ one output at the TPOT SLO (handoff
    `migrate`: one token)."""
    tokens = 1.0 if handoff == "migrate" else max(output_mean, 1.0)
    return {"prefill": slo_ttft, "decode": tokens * slo_tpot}


def plan_switches(pools: list[PoolVerdict], costs: SwitchCosts | None = None
                  ) -> tuple[list[tuple[str, str]], list[PoolVerdict]]:
    """([(from pool, to pool)] one per worker to switch, the verdicts left to scale: desired reduced by the
    switches, so a pool fully served by switches holds). `costs`: switch only where it pays (None: always)."""
    up = [v for v in pools if v.action == "up"]
    down = [v for v in pools if v.action == "down"]
    if len(up) != 1 or len(down) != 1:
        return [], list(pools)
    g, s = up[0], down[0]
    if costs is not None and not costs.switch_pays(s.pool):
        return [], list(pools)
    n = min(g.desired - g.current, s.current - s.desired)
    moves = [(s.pool, g.pool)] * n
    after = {g.pool: g.current + n, s.pool: s.current - n}
    left = [replace(v, current=after[v.pool], reason=v.reason + f" ({n} by role switch)") if v.pool in after else v
            for v in pools]
    return moves, left


def mark_switches(pools: list[PoolVerdict], costs: SwitchCosts | None,
                  give: Callable[[str], tuple[bool, str]] | None = None) -> list[PoolVerdict]:
    """The decision's verdicts with the switches in them: the source pool's verdict becomes action "switch"
    (desired = current - the workers moving, `switch_to` the growing pool), the growing pool's reason says how many
    it gets by switch. Up + down: min(growth, shrink) move. Up + hold: one moves when `give(source pool)` says the
    source has a measured spare worker (surplus.py); its reason is kept in the verdict either way."""
    up = [v for v in pools if v.action == "up"]
    if len(up) != 1 or len(pools) != 2:
        return list(pools)
    g = up[0]
    s = next(v for v in pools if v is not g)
    if s.action == "down":
        n, why = min(g.desired - g.current, s.current - s.desired), s.reason
    elif s.action == "hold" and give is not None:
        ok, why = give(s.pool)
        if not ok:
            return [replace(v, reason=v.reason + f"; no switch to {g.pool}: {why}") if v is s else v for v in pools]
        n = 1
    else:
        return list(pools)
    if costs is not None and not costs.switch_pays(s.pool):
        note = (f"; a start ({costs.start_s:.0f} s) beats a switch (drain ~{costs.drain_s.get(s.pool, 0.0):.1f} s "
                f"+ {costs.switch_s:.1f} s)")
        return [replace(v, reason=v.reason + note) if v is s else v for v in pools]
    cost = "" if costs is None else (f"; a switch (drain ~{costs.drain_s.get(s.pool, 0.0):.1f} s + "
                                     f"{costs.switch_s:.1f} s) beats a start ({costs.start_s:.0f} s)")
    moved = replace(s, desired=s.current - n, switch_to=g.pool, reason=f"{n} to {g.pool}: {why}{cost}")
    grown = replace(g, reason=g.reason + f"; {n} by role switch from {s.pool}")
    return [grown if v is g else moved for v in pools]
