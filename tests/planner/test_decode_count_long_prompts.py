"""The decode count the planner's model gives for long prompts with short outputs: it must follow the decode load,
not the prefill pool's TTFT (when it followed the TTFT, the e2e switch test failed 1 run in 7).

The inputs are those of the e2e run (tests/e2e/test_planner_switch.py, its planner log): after the shift,
735-token prompts / 7-token outputs at ~1.5 req/s (window max), TTFT SLO 1 s and TPOT SLO 0.25 s corrected by the
factors learned in the short phase (x3.17 TTFT, x1.48 TPOT: 315 ms / 169 ms). The cost model is the order this
box measures (prefill ~1500 tok/s, a decode step of 10 ms + 2 ms a sequence): one 735-token prefill takes ~0.49 s,
more than the corrected TTFT SLO, so one prefill replica meets it at no rate in simulation.

What went wrong: `pool_rates` swept the decode replica only up to 8 x the prefill replica's capacity *under the
TTFT SLO* (its feeding pool's), so that capacity 0 made the decode capacity 0 too - "one replica cannot meet the
TPOT SLO at any rate", the decode pool's maximum (2) - and the planner, holding decode at the model's 2, started a
prefill worker instead of switching a decode one. A tight but feasible TTFT SLO gave 8 x a small capacity (0.6
req/s), again 2 decode workers for a load one serves many times over.
"""
from __future__ import annotations

import asyncio

from pdserve.engine.config import EngineConfig
from pdserve.planner.costs import LiveCosts
from pdserve.planner.guard_rails import Guard, PoolLimits
from pdserve.planner.loop import Planner, PlannerConfig
from pdserve.planner.scrape import Observation
from pdserve.planner.sizing import Sizer, Sizing, Workload
from pdserve.planner.surplus import PoolLoad
from pdserve.sim.costmodel import LinearCostModel
from pdserve.sim.plan import PlanInput, pool_rates, prefill_throughput
from pdserve.sim.workload import SLO
from tests.planner.test_switch_on_surplus import Connector  # 1 prefill, 2 decode by default

A, B, C = 0.010, 1 / 1500, 0.002
COSTS = LiveCosts(LinearCostModel(a=A, b=B, c=C), 512, 256, ("a", "b", "c"))
SLO_TTFT, SLO_TPOT = 1.0, 0.25
CORRECTED = SLO(ttft=SLO_TTFT / 3.17, tpot=SLO_TPOT / 1.48)
LONG = Workload(735, 7)
INTERVAL = 2.0


def plan_input(b: float = B, requests: int = 40) -> PlanInput:
    wl = LONG
    return PlanInput(rate=8.0, slo=CORRECTED, workload=lambda r, n, s: wl.requests(r, n, s),
                     cost=LinearCostModel(a=A, b=b, c=C), num_blocks=512, engine=EngineConfig(max_num_seqs=256),
                     redundancy=0, requests=requests, sweep_requests=requests, modes=("disagg",))


def test_prefill_throughput_hand_computed():
    # 735-token prompts (uniform 368..1102, mean ~735) in chunks of 2048: one step each, a + b x tokens
    # = 0.010 + 735 / 1500 = 0.50 s -> ~2.0 req/s
    r = prefill_throughput(plan_input())
    assert 1.8 < r < 2.2, r


def test_decode_capacity_does_not_follow_the_prefill_ttft():
    # one prefill: 0.50 s > the corrected TTFT SLO 0.315 s -> no rate meets it
    p, d = pool_rates(plan_input(), cap=8.0)
    assert p == 0.0
    # one decode replica: at 8 req/s x 7 tokens x a step of ~10-20 ms it holds ~1-2 sequences, a step of
    # 0.010 + 0.002 x 2 = 14 ms, far inside the 169 ms TPOT SLO: the whole sweep (to its cap of 8) meets it
    assert d >= 0.95 * 8.0, d   # the old sweep: 8 x p = 0 ("cannot meet the TPOT SLO at any rate")


class RecordedSizer(Sizer):
    """The e2e run's sizing: until the window holds only long requests, the counts its log recorded (1 prefill, 2
    decode: "decode 2->2 [hold: forecast needs 2]" in the short phase; stale in the first long interval: "no shrink
    on the last capacities (the current ones are being computed)"); for the long lengths the real sizer (inline
    sweeps, fewer simulated requests) on the SLO as corrected in that run - the failing run's case: the capacities
    for the long phase's lengths ready when the grow is confirmed."""

    def size(self, rate, wl, costs, slo):
        if wl.prompt < 600:
            return Sizing(1, 2, rate, True, 8.0, 4.0, stale=wl.prompt > 100, lengths=(44.0, 48.0))
        return super().size(rate, wl, costs, CORRECTED)


def obs(rate, prompt, output, ttft, tpot):
    return Observation(window_s=INTERVAL, rate=rate, requests=rate * INTERVAL, prompt_mean=prompt,
                       output_mean=output, prefix_hit=0.0, ttft_p90=ttft, tpot_p90=tpot, queued=0)


def test_the_long_phase_switches_a_decode_worker():
    """The e2e run's decisions, replayed: 2 short intervals (the model not yet checked: no drain), then long ones whose TTFT breaks the SLO; the decode
    workers measure a 10 ms step, 2 ms a sequence, nothing running. The grow confirmed in the second long interval
    takes decode-2 by switch: the model's decode count for the long lengths (capacities computed, not stale) is 1,
    and the reason says from what. Before the fix the same inputs gave 'no switch to prefill: the model needs 2
    decode' and a started prefill worker."""
    conn = Connector()
    cfg = PlannerConfig(redis_url="redis://127.0.0.1:1/0", model="m", interval_s=INTERVAL, slo_ttft=SLO_TTFT,
                        slo_tpot=SLO_TPOT, limits=PoolLimits(1, 2, 1, 2), cooldown_s=2 * INTERVAL, window=2,
                        background=False)
    p = Planner(cfg, conn, lambda: [])
    p.sizer = RecordedSizer(cfg.limits, background=False, requests=40, sweep_requests=40)
    phases = [obs(6.0, 44, 48, 0.18, 0.011)] * 2 + [obs(1.5, 735, 7, 4.75, 0.010)] * 3
    decisions = []
    for i, o in enumerate(phases):
        loads = {"prefill": PoolLoad(conn.n["prefill"], 1, 40, 512, 256, 1500.0),
                 "decode": PoolLoad(conn.n["decode"], 0, 0, 512, 256, 0.0, A, C)}
        d = p.decide(o, COSTS, conn.replicas(), i * INTERVAL, loads=loads)
        asyncio.run(p._apply(d.pools, i * INTERVAL))
        decisions.append(d)
    # one worker moved by role switch, none started (the grown pool's scale to 2 finds it there)
    assert conn.calls[0] == ("switch", "decode", "prefill") and conn.n == {"prefill": 2, "decode": 1}, (
        conn.calls, [(v.pool, v.current, v.desired, v.reason) for d in decisions for v in d.pools])
    assert ("switch", "decode", "prefill") not in conn.calls[1:] and ("scale", "prefill", 3) not in conn.calls
    sw = next(d for d in decisions if any(v.action == "switch" for v in d.pools))
    assert sw is decisions[3]  # the second long interval: the grow confirmed
    dec = next(v for v in sw.pools if v.pool == "decode")
    # the model's own count for the long lengths (capacities computed for them, not stale) is 1: a decode replica
    # serves the sweep's whole range (8 req/s, "at least") where it said 0 before; the shrink pairs with the grow
    assert not sw.model_stale and sw.decode_capacity >= 0.95 * 8.0 and sw.prefill_capacity == 0.0
    assert dec.action == "switch" and dec.desired == 1 and "every recent interval needed at most 1" in dec.reason
    assert "one replica serves 0 (prefill) / 8" in sw.line(), sw.line()



def test_an_interval_with_nothing_finished_neither_confirms_nor_resets_a_violation():
    g = Guard(PoolLimits(1, 2, 1, 2), cooldown_s=0, confirm=2)
    v = g.decide("prefill", 1, 1, 1, "TTFT p90 4750 ms > SLO 1000 ms", True, 0.0)
    assert v.desired == 1 and "1 of 2 intervals to confirm" in v.reason
    v = g.decide("prefill", 1, 1, 1, None, True, 2.0, measured=False)  # no request finished: no p90
    assert v.desired == 1
    v = g.decide("prefill", 1, 1, 1, "TTFT p90 4750 ms > SLO 1000 ms", True, 4.0)
    assert v.desired == 2 and "while the model says 1 suffice" in v.reason, v.reason
    # a measured interval within the SLO does reset it
    g = Guard(PoolLimits(1, 2, 1, 2), cooldown_s=0, confirm=2)
    g.decide("prefill", 1, 1, 1, "TTFT p90 4750 ms > SLO 1000 ms", True, 0.0)
    g.decide("prefill", 1, 1, 1, None, True, 2.0, measured=True)
    assert g.decide("prefill", 1, 1, 1, "TTFT p90 4750 ms > SLO 1000 ms", True, 4.0).desired == 1
