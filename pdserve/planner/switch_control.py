"""The simulator's P:D controller with role switches: every `interval_s` of virtual time it sizes the split of a
fixed number of workers for the last interval's arrivals, and moves workers between the pools - by a role switch
(sim/role_switch.py) where planner/switching.py's rule says a switch beats a new pod, else by a new pod started
beside the old one's drain (the planner's start + drain).

The split (`split_for`) gives each pool workers in proportion to the work the interval's arrivals bring it, in
replica-seconds per second: a prompt costs its prefill step (the fixed part of a step shared by the prompts one
chunk budget packs); an output token costs a decode step at the largest batch that still meets the TPOT SLO (and
fits the KV pool and `max_num_seqs`), divided by that batch. Equal utilisation of both pools is what the planner's
simulated capacities amount to under a steady load, without its sweeps of simulations (too slow to rerun every
interval of a 64-worker trace here).

Which split the controller asks for (`sizing`):

- `need` (default): each pool needs its work at `target_util` (the workers it keeps busy, over the utilisation that
  leaves a queue room); any split in [prefill need, total - decode need] serves both, so the controller keeps the
  split it has while it lies in that band and otherwise moves the fewest workers that bring it in (`split_needed`).
  Where no split serves both (the band is empty), it asks for the work's share as `share` does. Either way a
  split within `overload_band` x total workers (less one) of the one asked for stays. A move goes as far as every
  confirming interval asked; a pool short of its work even fully busy moves at once, without confirmation.
- `share` (what the controller did first, kept to measure against): every interval the work's share
  (`split_for`), whatever the split it has. It sized the idle pool down to its own small work: at 64 workers on the
  shift trace 61P+3D in the long phase, whose 3 decode workers then took the second chat phase's first seconds of
  streams alone (docs/planner.md, "Switching at 64 workers").

As the planner's guard rails (guard_rails.py), a change is made once `confirm` consecutive intervals asked for it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.planner.guard_rails import PoolVerdict
from pdserve.planner.switching import SwitchCosts, drain_estimate, plan_switches
from pdserve.sim.costmodel import StepShape
from pdserve.sim.role_switch import SimSwitcher


@dataclass(frozen=True)
class ControlSpec:
    interval_s: float = 2.0
    confirm: int = 2
    switch_s: float = 0.5          # planner/switching.py's SWITCH_S (measured: bench/role_switch.py)
    start_s: float = 30.0          # a new pod: asked for -> serving
    slo_ttft: float = 0.5
    slo_tpot: float = 0.05
    handoff: str = "drain"         # a switching decode worker's streams: finished there, or migrated (role_switch.py)
    sizing: str = "need"           # need | share (module docstring)
    target_util: float = 0.8       # `need`: the busy share of a pool's workers it is sized for
    overload_band: float = 1 / 16  # `need`, no split serves both: the least move, as a share of all workers


@dataclass
class PoolShape:
    max_num_seqs: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int


def decode_batch(cost, shape: PoolShape, context: float, slo_tpot: float) -> int:
    """The largest decode batch whose step meets the TPOT SLO at this mean context and fits the pool (>= 1)."""
    per_seq_blocks = max(1, -(-int(context) // shape.block_size))
    hi = max(1, min(shape.max_num_seqs, shape.num_blocks // per_seq_blocks))
    best = 1
    lo_b, hi_b = 1, hi
    while lo_b <= hi_b:  # step time grows with the batch: bisect
        mid = (lo_b + hi_b) // 2
        if cost.step_time(StepShape.decode(mid, int(mid * context))) <= slo_tpot:
            best, lo_b = mid, mid + 1
        else:
            hi_b = mid - 1
    return best


def pool_work(specs, cost, shape: PoolShape, slo_tpot: float) -> tuple[float, float]:
    """(prefill, decode) replica-seconds the requests bring (module docstring)."""
    if not specs:
        return 0.0, 0.0
    a0 = cost.step_time(StepShape.prefill(1))
    pre = sum(cost.step_time(StepShape.prefill(s.prompt_len)) - a0 * (1 - min(1.0, s.prompt_len
                                                                              / shape.max_num_batched_tokens))
              for s in specs)
    out = sum(s.output_len for s in specs)
    ctx = sum(s.prompt_len + s.output_len / 2 for s in specs) / len(specs)
    b = decode_batch(cost, shape, ctx, slo_tpot)
    return pre, out * cost.step_time(StepShape.decode(b, int(b * ctx))) / b


def split_for(specs, cost, shape: PoolShape, total: int, slo_tpot: float) -> int:
    """Prefill workers of `total` for these requests, in [1, total - 1]."""
    pre, dec = pool_work(specs, cost, shape, slo_tpot)
    if pre + dec <= 0:
        return max(1, total // 2)
    return min(total - 1, max(1, round(total * pre / (pre + dec))))


def split_needed(need_p: float, need_d: float, cur: int, total: int, band: float = 1 / 16) -> int:
    """Prefill workers of `total` after the fewest moves from `cur` that give each pool its need (workers, at the
    target utilisation: module docstring); where no split does, the needs' share. Either way `cur` stays while it is
    within `band` x total workers of what is asked, less one (64 workers: 3; up to 23 workers: 0): at 64 workers
    an interval's noise moves a pool's need by a worker or two, which is no cause to drain one."""
    slack = max(1, round(total * band)) - 1
    lo = max(1, math.ceil(need_p - 1e-9))
    hi = min(total - 1, total - math.ceil(need_d - 1e-9))
    if lo <= hi:
        return cur if lo - slack <= cur <= hi + slack else min(max(cur, lo), hi)
    share = min(total - 1, max(1, round(total * need_p / (need_p + need_d))))
    return share if abs(share - cur) > slack else cur


@dataclass
class SplitDecider:
    """The controller's decision, shared by the simulated cluster (SplitController) and a live deployment
    (bench/role_switch_goodput.py): once per interval, given that interval's arrivals and the prefill workers
    serving or bound for prefill, the split to move to now, or None."""
    spec: ControlSpec
    shape: PoolShape
    cost: object
    asks: list = field(default_factory=list)   # the splits asked for since the last one that kept `cur`
    history: list = field(default_factory=list)  # (time, target prefill, prefill serving or bound)

    def decide(self, now: float, window: list, cur: int, total: int) -> int | None:
        sp = self.spec
        want, urgent = self._want(window, cur, total) if window else (cur, False)
        same_way = [w for w in self.asks if sp.sizing == "share" or (w > cur) == (want > cur)]
        self.asks = [] if want == cur else same_way + [want]
        self.history.append((now, want, cur))
        if not self.asks or not (urgent or len(self.asks) >= sp.confirm):
            return None
        # `need`: as far as every confirming interval asked (one interval's noise does not overshoot)
        to = min(self.asks[-sp.confirm:], key=lambda w: abs(w - cur)) if sp.sizing == "need" else want
        self.asks = []
        return to

    def _want(self, window: list, cur: int, total: int) -> tuple[int, bool]:
        """The split asked for, and whether it is urgent: a pool short of its work even fully busy (`need`: that
        is a shift of the load, not an interval's noise, so it moves without waiting for `confirm` intervals)."""
        sp = self.spec
        if sp.sizing == "share":
            return split_for(window, self.cost, self.shape, total, sp.slo_tpot), False
        pre, dec = pool_work(window, self.cost, self.shape, sp.slo_tpot)
        per = sp.interval_s * sp.target_util
        want = split_needed(pre / per, dec / per, cur, total, sp.overload_band)
        return want, pre / sp.interval_s > cur or dec / sp.interval_s > total - cur


@dataclass
class SplitController:
    cluster: object
    spec: ControlSpec
    shape: PoolShape
    specs: list                      # the trace (arrival-ordered): what the gateway will have seen by each tick
    end_s: float
    switcher: SimSwitcher = None
    decider: SplitDecider = None
    _next: int = 0

    def __post_init__(self):
        self.switcher = self.switcher or SimSwitcher(self.cluster, handoff=self.spec.handoff)
        self.decider = self.decider or SplitDecider(self.spec, self.shape, self.cluster.cost)
        self.cluster._at(self.spec.interval_s, self.tick)

    @property
    def history(self) -> list:
        return self.decider.history

    def _window(self, now: float) -> list:
        i = self._next
        while self._next < len(self.specs) and self.specs[self._next].arrival <= now:
            self._next += 1
        return self.specs[i:self._next]

    def _prefill_bound(self) -> int:
        """Prefill workers serving or switching towards prefill."""
        act = self.switcher.active
        return sum(1 for r in self.cluster.replicas
                   if (act[r.name].dst if r.name in act else r.role) == "prefill")

    def tick(self) -> None:
        c, sp = self.cluster, self.spec
        window = self._window(c.now)
        total = len(c.replicas)
        cur = self._prefill_bound()
        to = self.decider.decide(c.now, window, cur, total)
        if to is not None:
            out_mean = sum(s.output_len for s in window) / len(window)
            self._move([PoolVerdict("prefill", cur, to, "split"), PoolVerdict("decode", total - cur, total - to,
                                                                               "split")], out_mean)
        if c.now + sp.interval_s < self.end_s:
            c._at(c.now + sp.interval_s, self.tick)

    def _move(self, verdicts: list[PoolVerdict], output_mean: float) -> None:
        sp = self.spec
        costs = SwitchCosts(sp.switch_s, sp.start_s, drain_estimate(output_mean, sp.slo_ttft, sp.slo_tpot,
                                                                    sp.handoff))
        moves, left = plan_switches(verdicts, costs)
        for src, dst in moves:
            self.switcher.start(self._pick(src), dst, sp.switch_s)
        up = [v for v in left if v.action == "up"]
        for _ in range(up[0].desired - up[0].current if up else 0):  # a new pod beside the old one's drain
            src = "decode" if up[0].pool == "prefill" else "prefill"
            self.switcher.start(self._pick(src), up[0].pool, sp.start_s, overlap=True)

    def _pick(self, pool: str):
        """The worker of `pool` that drains first: the least outstanding work."""
        cands = [r for r in self.cluster.replicas if r.role == pool and r.name not in self.switcher.active]
        return min(cands, key=lambda r: (r.outstanding() + len(r.remote_pending) + len(r.core.pinned)
                                         + self.cluster.inbound.get(r.name, 0), r.name))
