"""Planner parts with hand-computed answers: Prometheus parsing and quantiles, the predictor, the guard rails."""
from __future__ import annotations

import pytest

from pdserve.planner.guard_rails import Guard
from pdserve.planner.predictor import TrendPredictor
from pdserve.planner.scrape import Observation, Snapshot, observe, parse, quantile
from pdserve.planner.sizing import PoolLimits

PAGE_1 = """\
# TYPE pdserve_requests_terminal_total counter
pdserve_requests_terminal_total{model="m",state="FINISHED"} 10
pdserve_requests_terminal_total{model="m",state="CANCELLED"} 2
# TYPE pdserve_http_requests_in_flight gauge
pdserve_http_requests_in_flight{endpoint="/v1/completions",model="m"} 3
pdserve_http_requests_in_flight{endpoint="/health",model="m"} 1
# TYPE pdserve_request_prompt_tokens histogram
pdserve_request_prompt_tokens_bucket{le="+Inf",model="m"} 12
pdserve_request_prompt_tokens_count{model="m"} 12
pdserve_request_prompt_tokens_sum{model="m"} 1200
# TYPE pdserve_request_output_tokens histogram
pdserve_request_output_tokens_count{model="m"} 12
pdserve_request_output_tokens_sum{model="m"} 120
# TYPE pdserve_ttft_seconds histogram
pdserve_ttft_seconds_bucket{le="0.1",mode="disagg",model="m"} 4
pdserve_ttft_seconds_bucket{le="0.5",mode="disagg",model="m"} 10
pdserve_ttft_seconds_bucket{le="+Inf",mode="disagg",model="m"} 12
pdserve_ttft_seconds_count{mode="disagg",model="m"} 12
pdserve_ttft_seconds_sum{mode="disagg",model="m"} 3
# TYPE pdserve_gateway_requests_in_state gauge
pdserve_gateway_requests_in_state{model="m",state="QUEUED"} 2
pdserve_gateway_requests_in_state{model="m",state="DEGRADED"} 5
"""
PAGE_2 = PAGE_1.replace("} 10\n", "} 30\n", 1).replace('state="CANCELLED"} 2', 'state="CANCELLED"} 2') \
    .replace('/v1/completions",model="m"} 3', '/v1/completions",model="m"} 5') \
    .replace("prompt_tokens_count{model=\"m\"} 12", "prompt_tokens_count{model=\"m\"} 32") \
    .replace("prompt_tokens_sum{model=\"m\"} 1200", "prompt_tokens_sum{model=\"m\"} 5200") \
    .replace('le="0.1",mode="disagg",model="m"} 4', 'le="0.1",mode="disagg",model="m"} 14') \
    .replace('le="0.5",mode="disagg",model="m"} 10', 'le="0.5",mode="disagg",model="m"} 20') \
    .replace('le="+Inf",mode="disagg",model="m"} 12', 'le="+Inf",mode="disagg",model="m"} 32')
WORKER = """\
# TYPE pdserve_num_waiting gauge
pdserve_num_waiting{model="m",role="decode"} 4
# TYPE pdserve_prefix_cache_hits_total counter
pdserve_prefix_cache_hits_total{model="m",role="prefill"} 30
# TYPE pdserve_prefix_cache_queries_total counter
pdserve_prefix_cache_queries_total{model="m",role="prefill"} 100
"""


def test_parse_and_observe_hand_computed():
    a, b = Snapshot(t=0.0), Snapshot(t=10.0)
    parse(PAGE_1, a)
    parse(PAGE_2, b)
    parse(WORKER, b)
    assert (a.finished, a.in_flight, a.queued) == (12, 3, 2)  # /health in flight and DEGRADED not counted
    assert b.queued == 2 + 4
    o = observe(a, b)
    # 20 finished + in flight 3 -> 5: 22 arrived in 10 s
    assert o.rate == pytest.approx(2.2)
    assert o.requests == 20
    assert o.prompt_mean == pytest.approx(4000 / 20)
    assert o.output_mean is None  # no output observations in the window
    assert o.prefix_hit == pytest.approx(0.3)
    # TTFT increments: <=0.1: 10, <=0.5: 10, +Inf: 20. p90 rank 18 lies in +Inf -> the largest finite bound
    assert o.ttft_p90 == pytest.approx(0.5)
    assert o.tpot_p90 is None


def test_quantile_like_prometheus():
    before = {0.1: 0, 0.5: 0, 1.0: 0, float("inf"): 0}
    after = {0.1: 50, 0.5: 90, 1.0: 100, float("inf"): 100}
    # rank 50 of 100 -> exactly the 0.1 bound; rank 90 -> 0.5; rank 95 -> halfway through (0.5, 1.0]
    assert quantile(0.5, before, after) == pytest.approx(0.1)
    assert quantile(0.9, before, after) == pytest.approx(0.5)
    assert quantile(0.95, before, after) == pytest.approx(0.75)
    assert quantile(0.2, before, after) == pytest.approx(0.04)  # first bucket: from 0
    assert quantile(0.9, after, after) is None


def _obs(rate: float, n: float = 10.0, prompt: float = 100.0, output: float = 20.0) -> Observation:
    return Observation(window_s=10, rate=rate, requests=n, prompt_mean=prompt, output_mean=output, prefix_hit=0.0,
                       ttft_p90=None, tpot_p90=None, queued=0)


def test_predictor_step_follows_without_overshoot_and_ramp_leads():
    p = TrendPredictor(window=4)
    for r in (1, 1, 1, 8):
        p.add(_obs(r))
    f = p.forecast()
    # successive differences 0, 0, 7: median 0 -> the new level, no extrapolation of the jump
    assert f.rate == pytest.approx(8) and f.trend == 0 and f.hold_rate == 8
    p.add(_obs(8))
    assert p.forecast().rate == pytest.approx(8)  # differences 0, 7, 0
    q = TrendPredictor(window=4, horizon=1.0)
    for r in (2, 4, 6, 8):
        q.add(_obs(r))
    f = q.forecast()
    assert f.trend == pytest.approx(2) and f.rate == pytest.approx(10)
    d = TrendPredictor(window=3)
    for r in (8, 8, 1):
        d.add(_obs(r))
    f = d.forecast()
    # a fall: forecast the new level (a negative trend is not extrapolated), but a shrink must hold for 8
    assert f.rate == pytest.approx(1) and f.hold_rate == 8
    d.add(_obs(1))
    d.add(_obs(1))
    assert d.forecast().hold_rate == 1


def test_predictor_lengths_request_weighted_and_kept_through_idle():
    p = TrendPredictor(window=3)
    p.add(_obs(1, n=10, prompt=100, output=10))
    p.add(_obs(3, n=30, prompt=200, output=30))
    f = p.forecast()
    assert f.prompt_mean == pytest.approx((1000 + 6000) / 40) and f.output_mean == pytest.approx((100 + 900) / 40)
    for _ in range(3):
        p.add(Observation(10, 0.0, 0.0, None, None, 0.0, None, None, 0))
    assert p.forecast().prompt_mean == pytest.approx(175)


def test_guard_rails():
    g = Guard(PoolLimits(min_prefill=1, max_prefill=3, min_decode=1, max_decode=4), cooldown_s=60)
    # one step per interval without a violation
    v = g.decide("decode", 1, grow_to=4, shrink_to=4, violated=None, traffic=True, now=0)
    assert (v.desired, v.action) == (2, "up") and "one step" in v.reason
    g.applied("decode", 0)
    # a violated SLO lets the pool jump to the model's count (bounded by max)
    v = g.decide("decode", 2, grow_to=9, shrink_to=9, violated="TPOT p90 80 ms > SLO 50 ms", traffic=True, now=10)
    assert v.desired == 4 and "bounded" in v.reason
    # violated while the model says enough: one more anyway
    v = g.decide("prefill", 1, grow_to=1, shrink_to=1, violated="TTFT p90 2 s > SLO 1 s", traffic=True, now=10)
    assert v.desired == 2 and "TTFT" in v.reason
    # shrink: not within the cooldown of the last change, then one step at a time
    v = g.decide("decode", 4, grow_to=1, shrink_to=1, violated=None, traffic=True, now=30)
    assert v.desired == 4 and "cooldown" in v.reason
    v = g.decide("decode", 4, grow_to=1, shrink_to=1, violated=None, traffic=True, now=61)
    assert v.desired == 3
    # the shrink target is the window max's count, not the forecast's
    v = g.decide("decode", 3, grow_to=1, shrink_to=3, violated=None, traffic=True, now=200)
    assert v.action == "hold"
    # never below one replica while serving traffic, even with min 0; idle may go to min
    g0 = Guard(PoolLimits(0, 2, 0, 2), cooldown_s=0)
    assert g0.decide("prefill", 1, 0, 0, None, traffic=True, now=0).desired == 1
    assert g0.decide("prefill", 1, 0, 0, None, traffic=False, now=0).desired == 0


def test_predictor_window_of_three_follows_a_step_without_overshoot():
    p = TrendPredictor(window=3)
    for r in (1, 1, 16):
        p.add(_obs(r))
    assert p.forecast().rate == pytest.approx(16)  # differences 0, 15: the low median is 0


def test_guard_no_feedback_step_while_a_replica_is_starting():
    g = Guard(PoolLimits(1, 4, 1, 4), cooldown_s=0)
    # measured TPOT violated, model says 2 suffice, the pool has 2 counted of which 1 is still starting
    v = g.decide("decode", 2, grow_to=2, shrink_to=2, violated="TPOT p90 9 ms > SLO 5 ms", traffic=True, now=0,
                 starting=1)
    assert v.action == "hold" and "still starting" in v.reason
    # the model's own count still applies (one step)
    v = g.decide("decode", 2, grow_to=3, shrink_to=3, violated="TPOT p90 9 ms > SLO 5 ms", traffic=True, now=0,
                 starting=1)
    assert v.desired == 3
    # once it serves, the violation counts again
    v = g.decide("decode", 2, grow_to=2, shrink_to=2, violated="TPOT p90 9 ms > SLO 5 ms", traffic=True, now=0)
    assert v.desired == 3


def test_guard_no_shrink_on_an_unchecked_model_or_stale_capacities():
    g = Guard(PoolLimits(1, 4, 1, 4), cooldown_s=0)
    v = g.decide("decode", 2, grow_to=1, shrink_to=1, violated=None, traffic=True, now=100, checked=False)
    assert v.action == "hold" and "not yet checked" in v.reason
    v = g.decide("decode", 2, grow_to=1, shrink_to=1, violated=None, traffic=True, now=100, stale=True)
    assert v.action == "hold" and "last capacities" in v.reason
    # growing on stale capacities is allowed (once confirmed, as always)
    g2 = Guard(PoolLimits(1, 4, 1, 4), cooldown_s=0, confirm=2)
    assert g2.decide("decode", 1, 2, 2, None, True, 0, stale=True).action == "hold"
    assert g2.decide("decode", 1, 2, 2, None, True, 5, stale=True).action == "up"
    assert g.decide("decode", 2, 1, 1, None, traffic=True, now=100).action == "down"
