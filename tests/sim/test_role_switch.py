"""Role switches in the simulator (sim/role_switch.py) and the split controller's sizing (planner/switch_control.py):
timelines and splits worked out by hand from a cost model of round numbers."""
from __future__ import annotations

import pytest

from pdserve.bench.workload import RequestSpec
from pdserve.engine.config import EngineConfig
from pdserve.planner.switch_control import PoolShape, decode_batch, pool_work, split_for
from pdserve.sim.cluster import Cluster, ClusterSpec
from pdserve.sim.costmodel import LinearCostModel
from pdserve.sim.role_switch import SimSwitcher

# every step 10 ms whatever it holds; KV transfer free: a request's timeline is whole steps
FLAT = LinearCostModel(a=0.01, b=0.0, c=0.0, d=0.0)
CFG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256)


def _req(idx, t, out, n=32):
    return RequestSpec(idx, t, [1000 + idx] * 16 + list(range(3, 3 + n - 16)), n, out)


def _cluster(p=1, d=2):
    return Cluster(ClusterSpec(prefill=p, decode=d, num_blocks=256, engine=CFG, admission=None), FLAT)


def _rep(c, name):
    return next(r for r in c.replicas if r.name == name)


def test_idle_worker_switches_in_switch_s():
    c = _cluster()
    sw = SimSwitcher(c)
    rec = []
    c._at(1.0, lambda: rec.append(sw.start(_rep(c, "decode-1"), "prefill", 0.5)))
    c.run([])
    r = rec[0]
    assert (r.outcome, r.drained, r.serving) == ("switched", 1.0, 1.5)
    assert _rep(c, "decode-1").role == "prefill"
    assert sorted(c.placer.pools["prefill"]) == ["decode-1", "prefill-0"] and c.placer.pools["decode"] == ["decode-0"]


def test_decode_worker_finishes_its_stream_first_and_takes_nothing_new():
    """One request, 5 output tokens: prefill step 0-10 ms (first token), commit at 10 ms, 4 decode steps -> done at
    50 ms. The switch asked at 20 ms drains at 50 ms (polled every 5 ms), serves at 50 + 500 ms. A request arriving
    at 30 ms must go to the other decode worker."""
    c = _cluster(1, 2)
    sw = SimSwitcher(c, poll_s=0.005)
    rec = []
    def switch_its_decoder():
        rec.append(sw.start(_rep(c, c.requests[0].decode_replica), "prefill", 0.5))

    c._at(0.02, switch_its_decoder)
    reqs = c.run([_req(0, 0.0, 5), _req(1, 0.03, 3)])
    r = rec[0]
    assert reqs[0].emits == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])
    assert r.drained == pytest.approx(0.05, abs=0.0051) and r.serving == pytest.approx(r.drained + 0.5)
    assert reqs[1].decode_replica != r.replica and reqs[1].state == "FINISHED"
    assert r.outcome == "switched"


# 10 ms a step plus 1 ms per prefill token: a re-prefill shows in the timeline
PRE = LinearCostModel(a=0.01, b=0.001, c=0.0, d=0.0)


def test_migrate_handoff_moves_the_stream_at_the_next_step_boundary():
    """One request, 32-token prompt, 20 output tokens. Prefill 0-42 ms (0.01 + 0.032), committed on its decode
    worker at 42 ms (the first token), decode steps of 10 ms: 52, 62 ms. The switch asked at 55 ms (mid-step)
    hands the stream off at that step's end, 62 ms, with 3 tokens sent: the other decode worker prefills prompt +
    those 3 = 35 tokens (0.045 s: 4th token at 107 ms), then decodes the 16 left, the last at 267 ms. The switching
    worker is drained at 62 ms (its poll: within 5 ms), not at the stream's end (232 ms uninterrupted)."""
    c = Cluster(ClusterSpec(prefill=1, decode=2, num_blocks=256, engine=CFG, admission=None), PRE)
    sw = SimSwitcher(c, poll_s=0.005, handoff="migrate")
    rec = []
    c._at(0.055, lambda: rec.append(sw.start(_rep(c, c.requests[0].decode_replica), "prefill", 0.5)))
    reqs = c.run([_req(0, 0.0, 20)])
    r = rec[0]
    want = [0.042, 0.052, 0.062, 0.107] + [0.107 + 0.01 * k for k in range(1, 17)]
    assert reqs[0].emits == pytest.approx(want)
    assert reqs[0].state == "FINISHED" and reqs[0].decode_replica != r.replica and sw.handed_off == 1
    assert r.outcome == "switched" and r.drained == pytest.approx(0.062, abs=0.0051)
    assert _rep(c, r.replica).role == "prefill" and not _rep(c, r.replica).reqs


def test_drain_handoff_keeps_the_stream_where_it_is():
    """The same switch with handoff `drain`: the stream ends on its worker at 232 ms, the drain with it."""
    c = Cluster(ClusterSpec(prefill=1, decode=2, num_blocks=256, engine=CFG, admission=None), PRE)
    sw = SimSwitcher(c, poll_s=0.005)
    rec = []
    c._at(0.055, lambda: rec.append(sw.start(_rep(c, c.requests[0].decode_replica), "prefill", 0.5)))
    reqs = c.run([_req(0, 0.0, 20)])
    assert reqs[0].emits == pytest.approx([0.042 + 0.01 * k for k in range(20)])
    assert rec[0].drained == pytest.approx(0.232, abs=0.0051) and sw.handed_off == 0


def test_a_pickup_still_prefilling_is_not_waited_for():
    """The request's decode worker switches at 20 ms while its prompt prefills (0-42 ms) on the prefill worker: the
    switch drains at once (the real worker holds no call for it yet), and the pickup at 42 ms goes to the other
    decode worker (the real one refuses it; the gateway asks for another), which streams from there."""
    c = Cluster(ClusterSpec(prefill=1, decode=2, num_blocks=256, engine=CFG, admission=None), PRE)
    sw = SimSwitcher(c, poll_s=0.005)
    rec = []
    c._at(0.02, lambda: rec.append(sw.start(_rep(c, c.requests[0].decode_replica), "prefill", 0.5)))
    reqs = c.run([_req(0, 0.0, 5)])
    r = rec[0]
    assert (r.drained, r.serving) == pytest.approx((0.02, 0.52))
    assert reqs[0].decode_replica != r.replica and reqs[0].state == "FINISHED"
    assert reqs[0].emits == pytest.approx([0.042 + 0.01 * k for k in range(5)])
    assert not _rep(c, "prefill-0").core.pinned and c.inbound == {"decode-0": 0, "decode-1": 0}


def test_drain_timeout_restores_the_old_role():
    c = _cluster(1, 1)
    sw = SimSwitcher(c, poll_s=0.005, drain_timeout_s=0.02)
    rec = []
    c._at(0.02, lambda: rec.append(sw.start(_rep(c, "decode-0"), "prefill", 0.5)))
    reqs = c.run([_req(0, 0.0, 20)])  # the stream runs to 0.20 s: past the 20 ms drain timeout
    assert rec[0].outcome == "drain_timeout" and _rep(c, "decode-0").role == "decode"
    assert rec[0].serving == pytest.approx(0.04, abs=0.0051)
    assert reqs[0].state == "FINISHED" and len(reqs[0].emits) == 20


def test_new_pod_start_overlaps_the_drain():
    """A new pod asked for at 20 ms with a 0.1 s start serves at 0.12 s, not after the 50 ms drain + 0.1 s."""
    c = _cluster(1, 2)
    sw = SimSwitcher(c)
    rec = []
    c._at(0.02, lambda: rec.append(sw.start(_rep(c, c.requests[0].decode_replica), "prefill", 0.1, overlap=True)))
    c.run([_req(0, 0.0, 5)])
    assert rec[0].serving == pytest.approx(0.12)


def test_a_second_switch_of_the_same_worker_is_refused():
    c = _cluster()
    sw = SimSwitcher(c)
    sw.start(_rep(c, "decode-0"), "prefill", 0.5)
    with pytest.raises(ValueError):
        sw.start(_rep(c, "decode-0"), "prefill", 0.5)
    with pytest.raises(ValueError):
        sw.start(_rep(c, "prefill-0"), "prefill", 0.5)


# step = 0.01 + 0.001 x prefill tokens + 0.002 x decode sequences
LIN = LinearCostModel(a=0.01, b=0.001, c=0.002, d=0.0)
SHAPE = PoolShape(max_num_seqs=256, num_blocks=100000, block_size=16, max_num_batched_tokens=1000)


def test_decode_batch_meets_the_tpot_slo():
    # 0.01 + 0.002 B <= 0.05 -> B <= 20; a KV pool of 30 blocks holds 3 sequences of 150 tokens (10 blocks each)
    assert decode_batch(LIN, SHAPE, 150, 0.05) == 20
    assert decode_batch(LIN, PoolShape(256, 30, 16, 1000), 150, 0.05) == 3
    assert decode_batch(LIN, SHAPE, 150, 0.001) == 1


def test_split_by_hand():
    """10 prompts of 100 tokens: a prefill step of 0.11 s less the unshared part of a 1-token step's fixed cost,
    0.011 x (1 - 100/1000) = 0.0099 -> 1.001 s of prefill; 10 x 120 output tokens at a 20-sequence step of 0.05 s
    -> 0.0025 s each = 3.0 s of decode. Prefill share 1.001 / 4.001 = 0.2502: 1 of 4 workers, 2 of 8; never 0."""
    specs = [RequestSpec(i, 0.0, [], 100, 120) for i in range(10)]
    pre, dec = pool_work(specs, LIN, SHAPE, 0.05)
    assert pre == pytest.approx(1.001) and dec == pytest.approx(3.0)
    assert split_for(specs, LIN, SHAPE, 4, 0.05) == 1
    assert split_for(specs, LIN, SHAPE, 8, 0.05) == 2
    assert split_for(specs, LIN, SHAPE, 2, 0.05) == 1
    # long prompts, 1-token outputs: all prefill work, yet one decode worker stays
    longp = [RequestSpec(i, 0.0, [], 900, 1) for i in range(10)]
    assert split_for(longp, LIN, SHAPE, 4, 0.05) == 3


def test_shift_compare_counts_every_request_in_every_mode(tmp_path):
    """`pdserve sim shift` end to end on 2 workers and a 3 x 1.5 s trace: each contender (switching once per
    handoff) served the whole trace (all finished: the load is light), and the best static split is the one with
    the highest goodput."""
    import json

    from pdserve.cli import main
    costs = tmp_path / "c.json"
    LIN.save(costs)
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as ex:
        main(["sim", "shift", "--workers", "2", "--time-scale", "0.05", "--costs", str(costs), "--json", str(out),
              "--handoff", "drain,migrate"])
    assert ex.value.code == 0
    res = json.loads(out.read_text())["results"][0]
    n = res["requests"]
    assert n > 20
    for key in ("switching", "colocated"):
        assert res[key]["n_total"] == n
    assert res["switching"]["mode"] == "switching (drain)"
    assert {h: r["n_total"] for h, r in res["switching_by_handoff"].items()} == {"drain": n, "migrate": n}
    assert [s["mode"] for s in res["statics"]] == ["static 1P+1D"]
    assert res["best_static"]["n_total"] == n
