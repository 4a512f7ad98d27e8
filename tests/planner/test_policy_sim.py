"""The planner's decision loop (predictor + simulator sizing + guard rails) through a load step up and down.

The load is fed as the interval observations a scrape would give; the counts each interval chooses are applied
(as a connector would) and then checked against the simulator itself, independently: a fresh cluster simulation
of the chosen counts at the step's rate, with another seed and more requests than the planner used, must meet the
SLOs at the target attainment. And no pool flaps: over the run each pool's count only rises, then only falls.
"""
from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.planner.loop import Planner, PlannerConfig
from pdserve.planner.scrape import Observation
from pdserve.planner.sizing import PoolLimits
from pdserve.sim.cluster import Cluster, ClusterSpec
from pdserve.sim.costmodel import LinearCostModel
from pdserve.sim.workload import SLO, LengthDist, synthetic

INTERVAL = 10.0
LOW, HIGH = 1.0, 16.0
PROMPT, OUTPUT = 256, 64
SLO_TTFT, SLO_TPOT = 0.5, 0.02
# a calibrated-looking linear model: 4 ms a step, 5k prefill tok/s, 1 ms per decode sequence
COST = LinearCostModel(a=0.004, b=2e-4, c=1e-3, kv_bytes_per_token=1000, link_bytes_per_s=1e9, handoff_s=0.005)
BLOCKS, SEQS = 2048, 32


class Pools:
    """What a connector holds: the counts last applied."""
    name = "test"

    def __init__(self):
        self.n = {"prefill": 1, "decode": 1}

    def replicas(self):
        return dict(self.n)


def _meets(p: int, d: int, rate: float) -> float:
    """Attainment of p prefill + d decode replicas at `rate`, simulated independently of the planner's runs."""
    pl, ol = LengthDist("uniform", PROMPT // 2, PROMPT * 3 // 2), LengthDist("uniform", OUTPUT // 2, OUTPUT * 3 // 2)
    c = Cluster(ClusterSpec(prefill=p, decode=d, num_blocks=BLOCKS, engine=EngineConfig(max_num_seqs=SEQS), seed=7),
                COST)
    c.run(synthetic(400, rate, pl, ol, seed=7))
    return c.summary(SLO(ttft=SLO_TTFT, tpot=SLO_TPOT))["slo"]["attainment_ratio"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    costs_file = tmp_path_factory.mktemp("planner") / "costs.json"
    COST.save(costs_file)
    cfg = PlannerConfig(redis_url="redis://127.0.0.1:6379/0", model="m", interval_s=INTERVAL, slo_ttft=SLO_TTFT,
                        slo_tpot=SLO_TPOT, limits=PoolLimits(1, 4, 1, 4), cooldown_s=2 * INTERVAL, window=3,
                        costs_file=str(costs_file), background=False)
    pools = Pools()
    planner = Planner(cfg, pools, lambda: [])
    from pdserve.planner.costs import LiveCosts
    costs = LiveCosts(planner.base_cost, BLOCKS, SEQS, ())
    rates = [LOW] * 3 + [HIGH] * 7 + [LOW] * 9
    history = []
    for i, rate in enumerate(rates):
        now = i * INTERVAL
        obs = Observation(window_s=INTERVAL, rate=rate, requests=rate * INTERVAL, prompt_mean=PROMPT,
                          output_mean=OUTPUT, prefix_hit=0.0, ttft_p90=None, tpot_p90=None, queued=0)
        d = planner.decide(obs, costs, pools.replicas(), now)
        for v in d.pools:
            if v.action != "hold":
                pools.n[v.pool] = v.desired
                planner.guard.applied(v.pool, now)
        history.append((rate, dict(pools.n), d))
    return history


def test_step_up_scales_out_and_meets_the_slo_in_simulation(run):
    high = [(n, d) for rate, n, d in run if rate == HIGH]
    second, settled = high[1][0], high[-1][0]
    # a grow is confirmed by a second interval (guard_rails.py): the step is acted on in its second
    assert high[0][0] == {"prefill": 1, "decode": 1}
    assert second["prefill"] + second["decode"] > 2, "the step was not acted on in its second interval"
    assert settled["prefill"] + settled["decode"] >= 3
    assert all(d.feasible for _, d in high)
    # the counts the planner settled on meet the SLOs at the step's rate in an independent simulation ...
    assert _meets(settled["prefill"], settled["decode"], HIGH) >= 0.9
    # ... and the 1P+1D it started from does not (the step needed the change)
    assert _meets(1, 1, HIGH) < 0.9


def test_step_down_returns_to_the_minimum_without_flapping(run):
    assert run[-1][1] == {"prefill": 1, "decode": 1}
    for pool in ("prefill", "decode"):
        counts = [n[pool] for _, n, _ in run]
        rates = [rate for rate, _, _ in run]
        steps = [b - a for a, b in zip(counts, counts[1:])]
        # while the load is high the pool never shrinks; once it is low again it never grows: no flap
        for i, s in enumerate(steps):
            assert s >= 0 if rates[i + 1] == HIGH else s <= 0, (pool, counts)
        # one replica per interval (no SLO violation was observed)
        assert all(abs(s) <= 1 for s in steps), (pool, counts)
    # no shrink while the window still holds a high interval, nor within the cooldown of the last change
    high_end = max(i for i, (rate, _, _) in enumerate(run) if rate == HIGH)
    for i in range(high_end + 1, high_end + 3):
        assert all(v.action != "down" for v in run[i][2].pools), run[i][2].line()


def test_every_decision_states_its_reason(run):
    for _, _, d in run:
        line = d.line()
        assert "forecast" in line and "TTFT SLO 500 ms" in line and "TPOT SLO 20 ms" in line
        assert all(v.reason for v in d.pools)
