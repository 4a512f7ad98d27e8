"""Switch a worker's role instead of starting one and draining another, when one pool must grow while the other
may shrink.

A switch (services/role_switch.py) takes a fraction of a second plus the old role's drain, in the same process with
its weights loaded; a new worker takes its load and warm-up (seconds here, minutes for a pod pulling an image and
weights). So when the guard rails (guard_rails.py) let one pool grow by `a` and the other shrink by `b`, min(a, b)
workers move from the shrinking pool to the growing one, and only the rest is started or drained. A connector
that cannot switch (`switch` absent) scales as before.
"""
from __future__ import annotations

from dataclasses import replace

from pdserve.planner.guard_rails import PoolVerdict


def plan_switches(pools: list[PoolVerdict]) -> tuple[list[tuple[str, str]], list[PoolVerdict]]:
    """([(from pool, to pool)] one per worker to switch, the verdicts left to scale: desired reduced by the
    switches, so a pool fully served by switches holds)."""
    up = [v for v in pools if v.action == "up"]
    down = [v for v in pools if v.action == "down"]
    if len(up) != 1 or len(down) != 1:
        return [], list(pools)
    g, s = up[0], down[0]
    n = min(g.desired - g.current, s.current - s.desired)
    moves = [(s.pool, g.pool)] * n
    after = {g.pool: g.current + n, s.pool: s.current - n}
    left = [replace(v, current=after[v.pool], reason=v.reason + f" ({n} by role switch)") if v.pool in after else v
            for v in pools]
    return moves, left
