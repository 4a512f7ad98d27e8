"""Metric math on hand-made traces with known answers (spec §2.1, §2.2)."""
from __future__ import annotations

import math
import random

import pytest

from pdserve.bench import metrics as MX
from pdserve.bench.metrics import SLO, ClientRecord


def rec(idx, scheduled, emits, n_out=None, prompt=None, ok=True, sent=None):
    return ClientRecord(idx=idx, scheduled=scheduled, sent=scheduled if sent is None else sent, emits=list(emits),
                         output_tokens=n_out, prompt_tokens=prompt, ok=ok, error=None if ok else "x")


def test_definitions_and_identity():
    r = rec(0, 10.0, [10.5, 10.6, 10.8, 11.0], n_out=4, sent=10.25)
    assert MX.ttft(r) == pytest.approx(0.5)                      # from the SCHEDULED arrival, not the send
    assert MX.itls(r) == pytest.approx([0.1, 0.2, 0.2])
    assert MX.tpot(r) == pytest.approx(0.5 / 3)                  # (t_last - t_first) / (N_out - 1)
    assert MX.e2e(r) == pytest.approx(1.0)
    assert MX.e2e(r) == pytest.approx(MX.ttft(r) + sum(MX.itls(r)))  # identity
    assert MX.send_lag(r) == pytest.approx(0.25)
    assert abs(MX.identity_residual(r)) < 1e-12


def test_identity_holds_on_random_traces():
    rng = random.Random(3)
    for i in range(200):
        t = rng.uniform(0, 100)
        emits = sorted(t + rng.uniform(0, 5) for _ in range(rng.randint(1, 40)))
        r = rec(i, t, emits, n_out=len(emits))
        assert abs(MX.identity_residual(r)) < 1e-9


def test_tpot_undefined_for_one_token_and_not_total_over_tokens():
    one = rec(0, 0.0, [0.3], n_out=1)
    assert MX.tpot(one) is None and MX.itls(one) == []
    # TPOT excludes queueing/prefill: a request that waited 5 s then decoded 3 tokens 10 ms apart has TPOT 10 ms,
    # not E2E / N_out
    slow = rec(1, 0.0, [5.0, 5.01, 5.02], n_out=3)
    assert MX.tpot(slow) == pytest.approx(0.01)
    assert MX.e2e(slow) / 3 == pytest.approx(5.02 / 3)
    s = MX.latency_summary([one, slow])
    assert s["tpot_s"]["n"] == 1 and s["tpot_undefined_n_out_lt_2"] == 1
    # the TPOT SLO is vacuous when TPOT is undefined
    assert SLO(ttft=1.0, tpot=0.001).met(one)


def test_tpot_uses_token_count_when_chunks_carry_several_tokens():
    r = rec(0, 0.0, [1.0, 2.0], n_out=5)  # 2 chunks, 5 tokens
    assert MX.tpot(r) == pytest.approx(1.0 / 4)
    assert MX.itls(r) == [1.0]  # ITL is per chunk (the client boundary)


def test_labelled_throughputs():
    # 4 requests, 100 prompt + 10 output tokens each; first scheduled at 0, last emit at 2.0 -> dt = 2 s
    recs = [rec(i, 0.5 * i, [0.5 * i + 0.1, 0.5 * i + 0.5], n_out=10, prompt=100) for i in range(4)]
    assert MX.window(recs) == pytest.approx(2.0)
    t = MX.throughput(recs)
    assert t["request_throughput_req_per_s"] == pytest.approx(2.0)
    assert t["output_token_throughput_tok_per_s"] == pytest.approx(20.0)
    assert t["total_token_throughput_tok_per_s"] == pytest.approx(220.0)


def test_goodput_vs_attainment_worked_example():
    """System A: 10 requests over 20 s, 8 within SLO -> attainment 0.8 (ratio), goodput 0.4 req/s (rate).
    System B: 100 requests over 10 s, 60 within SLO -> attainment 0.6 but goodput 6 req/s. The two quantities
    rank the systems in opposite orders, so neither can stand in for the other."""
    slo = SLO(ttft=1.0)
    a = [rec(i, 2.0 * i, [2.0 * i + (0.5 if i < 8 else 1.5)], n_out=1) for i in range(10)]
    a[-1].emits = [20.0]  # last emit at 20 s -> dt = 20 s
    sa = MX.slo_summary(a, slo)
    assert sa["attainment_ratio"] == pytest.approx(0.8) and sa["goodput_req_per_s"] == pytest.approx(0.4)
    b = [rec(i, 0.08 * i, [0.08 * i + (0.2 if i < 60 else 1.5)], n_out=1) for i in range(100)]
    b[-1].emits = [10.0]  # still a miss; last emit at 10 s -> dt = 10 s
    sb = MX.slo_summary(b, slo)
    assert sb["attainment_ratio"] == pytest.approx(0.6) and sb["goodput_req_per_s"] == pytest.approx(6.0)
    assert sa["attainment_ratio"] > sb["attainment_ratio"] and sa["goodput_req_per_s"] < sb["goodput_req_per_s"]


def test_failed_requests_count_against_attainment_not_throughput():
    slo = SLO(ttft=1.0)
    recs = [rec(0, 0.0, [0.1, 0.2], n_out=2, prompt=5), rec(1, 0.0, [], ok=False)]
    s = MX.summarize(recs, slo)
    assert s["slo"]["n_total"] == 2 and s["slo"]["attainment_ratio"] == 0.5
    assert s["throughput"]["completed"] == 1
    assert s["errors"] == {"x": 1}


def test_percentile_and_order_statistic_ci():
    xs = list(range(1, 101))
    assert MX.percentile(xs, 0.5) == pytest.approx(50.5)
    lo, hi = MX.quantile_ci(xs, 0.5)
    assert lo <= 50.5 <= hi and hi - lo < 25
    # p99 from 100 samples cannot be bounded above at 95%: needs n >= 368
    assert MX.quantile_ci(xs, 0.99)[1] is None
    assert MX.quantile_ci(list(range(368)), 0.99)[1] is not None
    assert MX.quantile_ci(list(range(367)), 0.99)[1] is None


def test_quantile_ci_coverage():
    """Distribution-free: the 95% CI of the p90 of Exp(1) covers the true value ln(10) in >= ~95% of trials."""
    rng = random.Random(7)
    true = math.log(10)
    hits = 0
    trials = 300
    for _ in range(trials):
        lo, hi = MX.quantile_ci([rng.expovariate(1.0) for _ in range(120)], 0.9)
        hits += lo <= true <= hi
    assert hits / trials >= 0.92


def test_breakeven_noise_rule():
    from pdserve.bench.breakeven import within_noise
    assert within_noise(12, 12, 12)          # same N_SLO: only the window's drain tail differs
    assert within_noise(8, 9, 12)            # one request of 12 is noise
    assert not within_noise(72, 1, 72)       # a collapse is not
    assert not within_noise(12, 6, 12)
