"""A server that stalls (every request frozen for 1 s, as a blocked engine would) while the schedule keeps
arriving. Latency from the scheduled arrival (open loop) shows the stall in p99; a closed-loop measurement,
whose users stop sending while they wait, records it once and hides it from p99 (coordinated omission)."""
from __future__ import annotations

import asyncio

from pdserve.bench.client import Target
from pdserve.bench.metrics import SLO
from pdserve.bench.runner import PointConfig, run_point
from pdserve.bench.workload import LengthDist, synthetic

STALL = 1.0


def test_stall_visible_open_loop_hidden_closed_loop(mock_factory):
    m = mock_factory("--ttft", "0.005", "--itl", "0.002", "--stall-at", "20", "--stall-s", str(STALL))
    target = Target(m.url)
    slo = SLO(ttft=0.25)
    specs = synthetic(150, 40.0, LengthDist.parse(8), LengthDist.parse(4), seed=2)  # ~3.7 s of arrivals
    m.reset()
    open_pt = asyncio.run(run_point(target, specs, PointConfig(offered_rate=40.0), slo))
    m.reset()
    closed_pt = asyncio.run(run_point(target, specs, PointConfig(concurrency=1), slo))

    o = open_pt["steady"]["latency"]["ttft_s"]
    c = closed_pt["steady"]["latency"]["ttft_s"]
    assert open_pt["mode"] == "open-loop" and closed_pt["mode"] == "closed-loop(concurrency=1)"
    assert open_pt["steady"]["n_ok"] == closed_pt["steady"]["n_ok"] == 150
    # both saw the stall once...
    assert o["max"] >= 0.9 * STALL and c["max"] >= 0.9 * STALL
    # ...but only the scheduled-time measurement counts the ~40 requests that arrived during it
    assert o["p99"] >= 0.6 * STALL, o
    assert o["p90"] >= 0.2 * STALL, o
    assert c["p99"] < 0.2 * STALL, c
    assert open_pt["steady"]["slo"]["attainment_ratio"] < 0.85 < closed_pt["steady"]["slo"]["attainment_ratio"]
    # the open-loop client kept its schedule while the server was stalled (it is not the bottleneck)
    assert open_pt["client"]["send_lag_s"]["p50"] < 0.02
    # E2E = TTFT + sum(ITL) on every request
    assert open_pt["steady"]["identity_max_abs_residual_s"] < 1e-9


def test_load_generator_keeps_its_heap_out_of_full_collections(mock_factory):
    """While a point runs, what the client process held before is frozen (a full collection of a test session's
    heap is a 100+ ms pause the client would book as server latency); afterwards the collector is as it was."""
    import gc

    from pdserve.bench.client import LoadGen
    m = mock_factory("--ttft", "0.001", "--itl", "0.001")
    held = [[{} for _ in range(10)] for _ in range(1000)]  # long-lived objects of the client's process
    during: list[int] = []
    gen = LoadGen(Target(m.url), on_done=lambda rec: during.append(gc.get_freeze_count()))
    records = asyncio.run(gen.run_open(synthetic(5, 50.0, LengthDist.parse(4), LengthDist.parse(2), seed=1)))
    assert len(records) == 5 and all(r.ok for r in records)
    assert len(during) == 5 and min(during) > len(held), during
    assert gc.get_freeze_count() == 0
