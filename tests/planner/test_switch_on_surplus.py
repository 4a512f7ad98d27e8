"""A grow paired with a role switch from a pool whose *measured* load leaves a spare worker (planner/surplus.py),
while the simulator's capacities are stale - the case in which no planner-driven switch ever happened before.

The scenario: 1 prefill + 2 decode replicas; short prompts / long outputs, then long prompts / short outputs whose
TTFT breaks the SLO. The capacities the planner sizes on are the last ones (stale: the sweep for the new lengths
is still running), so guard rule 5 holds any shrink of decode. The decode workers' LoadReports say what they carry;
the replicas that load needs are worked out by hand below. Under the old rule (switch only where the other pool's
verdict is "down") the planner started a third worker instead: `test_grow_pairs_with_a_switch_on_measured_surplus`
fails on it.
"""
from __future__ import annotations

import asyncio

import pytest

from pdserve.planner.costs import LiveCosts
from pdserve.planner.guard_rails import PoolLimits
from pdserve.planner.loop import Planner, PlannerConfig
from pdserve.planner.scrape import Observation
from pdserve.planner.sizing import Sizing
from pdserve.planner.surplus import PREFILL_UTIL, Demand, PoolLoad, Source, can_give, needed, pool_loads, shifted
from pdserve.services.pb import common_pb2
from pdserve.services.registry import WorkerRecord
from pdserve.sim.costmodel import LinearCostModel

INTERVAL = 5.0
SLO_TTFT, SLO_TPOT = 0.3, 0.05
COSTS = LiveCosts(LinearCostModel(), 256, 64, ())
# decode: 10 ms a step at an empty batch, +1 ms a sequence -> (50 - 10) / 1 = 40 sequences within the TPOT SLO
DECODE = dict(decode_step0_s=0.010, decode_step_per_seq_s=0.001, max_num_seqs=64, kv_blocks_total=256)
PREFILL = dict(prefill_tokens_per_s=4000.0, max_num_seqs=64, kv_blocks_total=256)


class StaleSizer:
    """The last capacities, computed for the first phase's lengths: one prefill and one decode replica suffice, and
    they are stale (the sweep for the current inputs runs) - what the 2-vCPU box showed in nearly every interval."""

    decode = 1
    lengths = (600.0, 6.0)  # what the capacities were computed for (None: none computed yet)

    def simulate_current(self, prefill, decode, rate, wl, costs):
        return (0.05, 0.02) if rate > 0 else (None, None)

    def size(self, rate, wl, costs, slo):
        return Sizing(1, self.decode, rate, True, 50.0, 20.0, stale=True, lengths=self.lengths)

    def close(self):
        pass


class Connector:
    """The counts a connector holds and the calls the planner made on it."""
    name = "test"

    def __init__(self, prefill=1, decode=2):
        self.n = {"prefill": prefill, "decode": decode}
        self.calls: list[tuple] = []

    def replicas(self):
        return dict(self.n)

    def switch(self, src, dst):
        self.calls.append(("switch", src, dst))
        self.n[src] -= 1
        self.n[dst] += 1
        return True

    def scale(self, pool, n):
        self.calls.append(("scale", pool, n))
        self.n[pool] = n


def planner(conn, cooldown_intervals: float = 2) -> Planner:
    cfg = PlannerConfig(redis_url="redis://127.0.0.1:1/0", model="m", interval_s=INTERVAL, slo_ttft=SLO_TTFT,
                        slo_tpot=SLO_TPOT, limits=PoolLimits(1, 2, 1, 2), cooldown_s=cooldown_intervals * INTERVAL,
                        window=3,
                        background=False)
    p = Planner(cfg, conn, lambda: [])
    p.sizer = StaleSizer()
    return p


def obs(prompt, output, ttft, tpot, rate=2.0):
    return Observation(window_s=INTERVAL, rate=rate, requests=rate * INTERVAL, prompt_mean=prompt,
                       output_mean=output, prefix_hit=0.0, ttft_p90=ttft, tpot_p90=tpot, queued=0)


def loads(conn, running=1, kv=4) -> dict[str, PoolLoad]:
    return {"prefill": PoolLoad(conn.n["prefill"], 1, 10, 256, 64, PREFILL["prefill_tokens_per_s"]),
            "decode": PoolLoad(conn.n["decode"], running, kv, 256, 64, 0.0, DECODE["decode_step0_s"],
                               DECODE["decode_step_per_seq_s"])}


def run(p, conn, phases, load=loads, t0=0.0):
    """Each interval: decide on the observation, apply (switches, scaling) as the loop does; the decisions."""
    out = []
    for i, o in enumerate(phases):
        now = t0 + i * INTERVAL
        d = p.decide(o, COSTS, conn.replicas(), now, loads=load(conn))
        asyncio.run(p._apply(d.pools, now))
        out.append(d)
    return out


SHORT = [obs(32, 96, 0.05, 0.02)] * 3           # short prompts, long outputs: TTFT 50 ms, met
LONG = [obs(600, 6, 0.6, 0.02)] * 4             # long prompts, short outputs: TTFT 600 ms > 300 ms


def test_measured_need_hand_computed():
    # prefill: 2 req/s x 600 tok = 1200 tok/s; one replica 4000 tok/s at 50% = 2000 -> 1200 x 1.2 / 2000 = 0.72 -> 1
    n, why = needed("prefill", loads(Connector())["prefill"], Demand(2.0, 600, 6, 0.02), SLO_TPOT, 1.2)
    assert n == 1 and "1200 tok/s" in why and PREFILL_UTIL == 0.5
    # 4 req/s x 600 = 2400 tok/s x 1.2 = 2880 > 2000 -> 2
    assert needed("prefill", loads(Connector())["prefill"], Demand(4.0, 600, 6, 0.02), SLO_TPOT, 1.2)[0] == 2
    dec = loads(Connector())["decode"]
    # decode: Little 2 req/s x 6 tok x 0.02 s = 0.24 sequences (1 running now: more) -> 1 x 1.2 / 40 -> 1 replica
    assert needed("decode", dec, Demand(2.0, 600, 6, 0.02), SLO_TPOT, 1.2)[0] == 1
    # 40 req/s x 96 tok x 0.02 s = 76.8 sequences x 1.2 = 92.2 / 40 seats -> 3 replicas
    assert needed("decode", dec, Demand(40.0, 32, 96, 0.02), SLO_TPOT, 1.2)[0] == 3
    # KV: 300 blocks in use x 1.2 = 360 > 256 a replica -> 2, whatever the sequences
    kv = PoolLoad(2, 1, 300, 256, 64, 0.0, 0.010, 0.001)
    assert needed("decode", kv, Demand(2.0, 600, 6, 0.02), SLO_TPOT, 1.2)[0] == 2
    # one replica's measured step (60 ms) misses the TPOT SLO: no figure, no switch
    slow = PoolLoad(2, 1, 4, 256, 64, 0.0, 0.060, 0.001)
    assert needed("decode", slow, Demand(2.0, 600, 6, 0.02), SLO_TPOT, 1.2)[0] is None
    # unmeasured (no traffic since start): nothing to rest a switch on
    assert needed("decode", PoolLoad(2), Demand(2.0, 600, 6, 0.02), SLO_TPOT, 1.2)[0] is None
    assert needed("prefill", PoolLoad(1), Demand(2.0, 600, 6, 0.02), SLO_TPOT, 1.2)[0] is None


def test_pool_loads_from_registry_records():
    def rec(wid, role, **load):
        return WorkerRecord(wid, role, "127.0.0.1:1", load=common_pb2.LoadReport(worker_id=wid, **load))
    ws = [rec("p", "prefill", prefill_tokens_per_s=3000.0, num_running=1),
          rec("d1", "decode", num_running=3, kv_blocks_in_use=10, kv_blocks_total=256, max_num_seqs=64,
              decode_step0_s=0.010, decode_step_per_seq_s=0.001),
          rec("d2", "decode", num_running=2, kv_blocks_in_use=6, kv_blocks_total=256, max_num_seqs=64,
              decode_step0_s=0.014, decode_step_per_seq_s=0.003),
          rec("d3", "decode", decode_step_s=0.020),  # a flat step line: no intercept, its step stands for it
          rec("s", "switching")]
    pl = pool_loads(ws)
    assert pl["prefill"].serving == 1 and pl["prefill"].prefill_tokens_per_s == 3000.0
    d = pl["decode"]
    assert (d.serving, d.running, d.kv_in_use, d.kv_per_replica, d.max_num_seqs) == (3, 5, 16, 256, 64)
    # medians of 10, 14, 20 ms and of 1, 3 ms (an unmeasured slope is no sample)
    assert d.decode_step0_s == pytest.approx(0.014) and d.decode_step_per_seq_s == pytest.approx(0.002)


def test_source_refusals():
    ld = loads(Connector())["decode"]
    dm = Demand(2.0, 600, 6, 0.02)
    ok = Source(2, 1, 0, 100.0, 10.0, False, True)
    assert can_give("decode", ok, ld, dm, SLO_TPOT, 1.2)[0]
    for src, word in ((Source(1, 1, 0, 100.0, 10.0, False, True), "minimum"),
                      (Source(1, 0, 0, 100.0, 10.0, False, True), "minimum"),      # never below 1 with traffic
                      (Source(2, 1, 1, 100.0, 10.0, False, True), "starting"),
                      (Source(2, 1, 0, 4.0, 10.0, False, True), "cooldown"),
                      (Source(2, 1, 0, 100.0, 10.0, True, True), "violated"),
                      (Source(2, 1, 0, 100.0, 10.0, False, True, model=2), "the model")):
        give, why = can_give("decode", src, ld, dm, SLO_TPOT, 1.2)
        assert not give and word in why, why
    give, why = can_give("decode", ok, PoolLoad(1, 1, 4, 256, 64, 0.0, 0.010, 0.001), dm, SLO_TPOT, 1.2)
    assert not give and "not all serving" in why
    # the load needs both replicas: 40 req/s of 96-token outputs (3 replicas' worth, above)
    give, why = can_give("decode", ok, ld, Demand(40.0, 32, 96, 0.02), SLO_TPOT, 1.2)
    assert not give and "needs 3 of 2" in why


def test_grow_pairs_with_a_switch_on_measured_surplus():
    conn = Connector()
    p = planner(conn)
    ds = run(p, conn, SHORT + LONG)
    # the short phase: nothing moves (TTFT met; decode's shrink held: stale capacities)
    assert all(not d.changed for d in ds[:3]), [d.line() for d in ds[:3]]
    assert "last capacities" in ds[0].pools[1].reason or "not yet checked" in ds[0].pools[1].reason
    # the first long interval asks (1 of 2 to confirm), the second grows prefill - by a decode worker's switch
    assert not ds[3].changed and "1 of 2" in ds[3].pools[0].reason
    d = ds[4]
    pre, dec = d.pools
    assert (pre.action, pre.current, pre.desired) == ("up", 1, 2) and "1 by role switch from decode" in pre.reason
    assert (dec.action, dec.current, dec.desired, dec.switch_to) == ("switch", 2, 1, "prefill")
    assert "measured load needs 1 of 2 decode" in dec.reason and "beats a start" in dec.reason
    assert "decode 2->1 [switch: 1 to prefill" in d.line()
    assert d.to_json()["pools"][1]["action"] == "switch"
    # applied as a switch: no worker started, none drained
    assert conn.calls == [("switch", "decode", "prefill"), ("scale", "prefill", 2)]
    assert conn.n == {"prefill": 2, "decode": 1}


@pytest.mark.parametrize("cooldown", [2, 3])
def test_a_switch_back_waits_for_the_cooldown_and_a_confirmed_grow(cooldown):
    conn = Connector()
    p = planner(conn, cooldown)
    run(p, conn, SHORT + LONG[:2])
    assert conn.n == {"prefill": 2, "decode": 1}
    conn.calls.clear()
    # back to long outputs and decode's TPOT violated (90 ms > 50 ms): decode must grow, and prefill (2 replicas, its
    # measured load needs 1) has a spare worker. The switch was at t = 20 s; these intervals are at 25, 30, 35 s
    back = [obs(32, 96, 0.05, 0.09)] * 3
    ds = run(p, conn, back, t0=5 * INTERVAL)
    assert not ds[0].changed and "1 of 2" in ds[0].pools[1].reason     # a grow needs 2 intervals
    pre, dec = ds[1].pools
    assert dec.action == "up"
    if cooldown == 2:  # 10 s after the switch: the cooldown is over, the worker moves back
        assert pre.action == "switch" and "measured load needs 1 of 2 prefill" in pre.reason
        assert conn.calls == [("switch", "prefill", "decode"), ("scale", "decode", 2)]
    else:  # 15 s cooldown: no switch back; the decode grow is a start (a grow is never held)
        assert pre.action == "hold" and "cooldown" in pre.reason, pre.reason
        assert conn.calls == [("scale", "decode", 2)]
    assert conn.n["prefill"] + conn.n["decode"] == (3 if cooldown == 2 else 4)


def test_no_switch_where_the_source_needs_all_its_workers():
    conn = Connector()
    p = planner(conn)
    busy = lambda c: loads(c, running=90)  # noqa: E731 - 90 sequences running on decode: 90 x 1.2 / 40 -> 3
    ds = run(p, conn, SHORT + LONG[:2], busy)
    pre, dec = ds[-1].pools
    assert pre.action == "up" and dec.action == "hold" and "no switch to prefill" in dec.reason
    assert conn.calls == [("scale", "prefill", 2)]  # started, as before


def test_no_switch_where_the_model_needs_all_the_source_has():
    """The measured load says decode needs 1, but the model's count (the last capacities) is 2: the corrected model
    grew it for what the measured figures do not see, and a switch on them alone would be undone by its next grow."""
    conn = Connector()
    p = planner(conn)
    p.sizer.decode = 2
    ds = run(p, conn, SHORT + LONG[:2])
    pre, dec = ds[-1].pools
    assert pre.action == "up" and dec.action == "hold"
    assert "no switch to prefill: the model needs 2 decode (the model's capacities are for 600/6" in dec.reason, (
        dec.reason)
    assert conn.calls == [("scale", "prefill", 2)]


def test_a_shift_the_model_lags_rests_on_the_measurement():
    """The last capacities were computed for the first phase's 32/96-token prompts/outputs and need 2 decode; this
    interval's are 600/6 (19x, 16x off): the model lags the shift, so the measured surplus decides alone. With the
    first phase's lengths (a steady load) the model's 2 holds."""
    assert shifted((32, 96), Demand(2, 600, 6, 0.02)) and not shifted((32, 96), Demand(2, 50, 60, 0.02))
    conn = Connector()
    p = planner(conn)
    p.sizer.decode, p.sizer.lengths = 2, (32.0, 96.0)
    ds = run(p, conn, SHORT + LONG[:2])
    pre, dec = ds[-1].pools
    assert pre.action == "up" and dec.action == "switch", dec.reason
    assert "for 32/96-token prompts/outputs, this interval's 600/6: a load shift" in dec.reason
    assert conn.n == {"prefill": 2, "decode": 1}
    # steady lengths: the same model blocks it (test_no_switch_where_the_model_needs_all_the_source_has); before
    # any capacities were computed the model has no count, and the measurement decides
    conn = Connector()
    p = planner(conn)
    p.sizer.decode, p.sizer.lengths = 2, None
    ds = run(p, conn, SHORT + LONG[:2])
    assert ds[-1].pools[1].action == "switch" and "no capacities computed yet" in ds[-1].pools[1].reason


def test_a_sizing_without_capacities_decides():
    """A sizing with no capacities behind it that is not stale (a rate of 0 sizes to the minimum without them) has
    no lengths: a grow paired with a switch still decides, on the measurement (this raised once, and the interval
    was skipped)."""
    conn = Connector()
    p = planner(conn)
    p.sizer.size = lambda rate, wl, costs, slo: Sizing(1, 2, rate, True, note="no load")
    ds = run(p, conn, SHORT + LONG[:2])
    pre, dec = ds[-1].pools
    assert (pre.action, dec.action) == ("up", "hold") and dec.reason.endswith("no switch to prefill: the model "
                                                                              "needs 2 decode"), ds[-1].line()
