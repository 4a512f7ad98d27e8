"""The linear step-time model: its shape accounting and its fit, against hand-computed values."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.sim.costmodel import LinearCostModel, StepShape
from pdserve.sim.executor import SimReplica, SimRequest

TRUE = dict(a=1.3e-3, b=2.1e-5, c=1.7e-4, d=3.0e-7, e=3.9e-3, f=4.0e-9)


def _true_time(s: StepShape) -> float:
    t = TRUE
    return (t["a"] + (t["e"] if s.prefill_seqs else 0.0) + t["b"] * s.prefill_tokens + t["c"] * s.decode_seqs
            + t["d"] * s.sum_context + t["f"] * s.prefill_pairs)


def _shapes(rng: random.Random) -> list[StepShape]:
    out = [StepShape.prefill(n) for n in (16, 32, 64, 128, 256, 512, 1000, 2000)]
    out += [StepShape.decode(b, b * ctx) for b in (1, 2, 4, 8, 16, 32, 64) for ctx in (16, 256, 700)]
    for _ in range(40):  # mixed steps: one chunk after some cached tokens, beside a decode batch
        n, start, b, ctx = rng.randint(8, 512), rng.randint(0, 512), rng.randint(1, 32), rng.randint(16, 800)
        pairs = n * start + n * (n + 1) // 2
        out.append(StepShape(prefill_tokens=n, prefill_seqs=1, decode_seqs=b, sum_context=start + n + b * ctx,
                             attn_pairs=pairs + b * ctx, samples=b + 1, prefill_pairs=pairs))
    return out


def test_of_scheduled_counts_prefill_pairs_apart_from_decode():
    def item(computed, total, n, prefill):
        return SimpleNamespace(seq=SimpleNamespace(num_computed_tokens=computed, num_tokens=total, is_prefill=prefill),
                               num_tokens=n)
    # a 10-token chunk after 6 cached (of a 20-token prompt) + two decodes at contexts 30 and 50
    s = StepShape.of_scheduled([item(6, 20, 10, True), item(29, 30, 1, False), item(49, 50, 1, False)])
    assert (s.prefill_tokens, s.prefill_seqs, s.decode_seqs) == (10, 1, 2)
    assert s.prefill_pairs == 10 * 6 + 55            # 115: every query sees the 6 cached keys + causal 1..10
    assert s.attn_pairs == 115 + 30 + 50
    assert s.sum_context == 16 + 30 + 50
    assert s.samples == 2                             # the chunk does not reach the prompt's end


def test_prefill_step_pays_its_own_intercept_and_quadratic_attention():
    cm = LinearCostModel(**TRUE)
    assert cm.step_time(StepShape.decode(4, 400)) == pytest.approx(1.3e-3 + 4 * 1.7e-4 + 400 * 3e-7)
    # 1000-token prompt: 500500 causal pairs
    assert cm.step_time(StepShape.prefill(1000)) == pytest.approx(
        1.3e-3 + 3.9e-3 + 1000 * 2.1e-5 + 1000 * 3e-7 + 500500 * 4.0e-9)


def test_fit_recovers_known_coefficients_under_noise_and_outliers():
    rng = random.Random(5)
    samples = []
    for s in _shapes(rng) * 3:
        t = _true_time(s) * (1 + rng.gauss(0, 0.01))
        if rng.random() < 0.05:
            t *= 2.5  # a step a neighbour slowed down: the second fitting pass drops it
        samples.append((s, t))
    cm = LinearCostModel.fit(samples)
    for k, v in TRUE.items():
        assert getattr(cm, k) == pytest.approx(v, rel=0.15), (k, getattr(cm, k), v)
    assert cm.meta["n_outliers_dropped"] >= 1
    assert cm.meta["median_rel_err"] < 0.02


def test_one_shared_intercept_misses_short_prefills():
    """The defect this model's second intercept fixes: with prefill and decode steps forced onto one intercept,
    the best fit under-predicts a short prompt's prefill by tens of percent."""
    rng = random.Random(6)
    samples = [(s, _true_time(s)) for s in _shapes(rng)]
    shared = LinearCostModel.fit([(StepShape(**{**s.__dict__, "prefill_seqs": 0, "prefill_pairs": 0}), t)
                                  for s, t in samples])
    full = LinearCostModel.fit(samples)
    short = StepShape.prefill(32)
    real = _true_time(short)
    shared_guess = shared.step_time(StepShape(**{**short.__dict__, "prefill_seqs": 0, "prefill_pairs": 0}))
    assert (shared_guess - real) / real < -0.2
    assert full.step_time(short) == pytest.approx(real, rel=0.02)


def test_old_model_files_load_with_no_prefill_terms(tmp_path):
    p = tmp_path / "m.json"
    p.write_text('{"kind": "linear", "a": 0.004, "b": 0.0002, "c": 0.001, "d": 0.0, "meta": {}}')
    cm = LinearCostModel.load(p)
    assert (cm.e, cm.f) == (0.0, 0.0)
    assert cm.step_time(StepShape.prefill(100)) == pytest.approx(0.004 + 0.02)


def test_wake_time_follows_the_idle_gap():
    cm = LinearCostModel(wake_s=0.002, wake_tau_s=0.04)
    assert cm.wake_time(0.0) == 0.0
    assert cm.wake_time(0.04) == pytest.approx(0.002 * (1 - math.exp(-1)))
    assert cm.wake_time(float("inf")) == pytest.approx(0.002)
    assert LinearCostModel().wake_time(1.0) == 0.0  # a model without the term (old files, hand-made models)


def test_replica_pays_the_wake_only_after_an_idle_gap():
    """The simulated replica: a step that starts when the previous one ended pays no wake; one that starts after
    an idle gap (or the first ever) pays wake_time(gap)."""
    cost = LinearCostModel(a=0.01, b=0.0, c=0.0, d=0.0, wake_s=0.005, wake_tau_s=0.04)
    rep = SimReplica("x", "both", EngineConfig(block_size=4), 64, cost, fingerprint="f", max_model_len=64,
                     vocab_size=100)
    rep.add(SimRequest("A", 0.0, [5, 6, 7], 3))
    out, dt = rep.begin_step(1.0)
    assert dt == pytest.approx(0.015)                 # first step: idle since forever
    rep.end_step(out, 1.0 + dt)
    out, dt = rep.begin_step(1.015)
    assert dt == pytest.approx(0.01)                  # back to back
    rep.end_step(out, 1.025)
    out, dt = rep.begin_step(1.065)                   # 40 ms idle
    assert dt == pytest.approx(0.01 + 0.005 * (1 - math.exp(-1)))
