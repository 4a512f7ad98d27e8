"""A worker's decode-step figures (services/load_meter.py) after a (re)start and through stalls, against the step
times that generated them: a restarted worker must not report its cold first steps (deadline-aware admission
refused requests `deadline_unreachable` for seconds on them), a stopped process's long step must not swing the
average, and a real slowdown must still show within a few steps."""
import pytest

from pdserve.services.load_meter import LoadMeter

WARM_S = 0.020 + 0.0005 * 4  # the true step at batch 4: 20 ms + 0.5 ms per sequence
COLD_S = 0.200               # the first steps of a fresh process


def _steps(m: LoadMeter, n: int, dt: float, batch: int = 4) -> None:
    for _ in range(n):
        m.observe_decode_step(batch, dt)


def test_cold_first_steps_are_not_reported():
    m = LoadMeter()
    _steps(m, m.DECODE_WARMUP, COLD_S)
    assert m.report().decode_step_s == 0.0  # nothing measured yet: unmeasured, not 200 ms
    _steps(m, m.DECODE_REPORT_AFTER - 1, WARM_S)
    assert m.report().decode_step_s == 0.0
    _steps(m, 1, WARM_S)
    assert m.report().decode_step_s == pytest.approx(WARM_S, rel=1e-9)  # the warm step, untouched by the cold ones


def test_a_stall_is_clipped_and_a_slowdown_still_shows():
    m = LoadMeter()
    _steps(m, m.DECODE_WARMUP + 20, WARM_S)
    _steps(m, 1, 0.300)  # SIGSTOPped mid-step for 0.3 s
    # at most one step at OUTLIER_X x the average enters the EWMA (alpha 0.2): 1 + 0.2 x 2 = 1.4 x
    assert m.report().decode_step_s <= WARM_S * 1.4 + 1e-12
    _steps(m, 15, WARM_S)
    assert m.report().decode_step_s == pytest.approx(WARM_S, rel=0.05)
    _steps(m, 15, 0.100)  # the worker really got 4.5 x slower (a noisy neighbour, long contexts)
    assert m.report().decode_step_s == pytest.approx(0.100, rel=0.05)


def test_the_decode_line_intercept_is_reported():
    """Steps over a range of batches from 20 ms + 0.5 ms per sequence: the report carries the line's intercept
    (admission's floor for a lone request) and slope, and no intercept while no slope is measured."""
    m = LoadMeter()
    _steps(m, m.DECODE_WARMUP + m.DECODE_REPORT_AFTER, WARM_S)  # batch 4 only: no spread, no slope
    assert m.report().decode_step0_s == 0.0
    for _ in range(10):
        for batch in (1, 8, 16, 32, 64):
            m.observe_decode_step(batch, 0.020 + 0.0005 * batch)
    rep = m.report()
    assert rep.decode_step0_s == pytest.approx(0.020, rel=0.02) and rep.decode_step_per_seq_s == pytest.approx(
        0.0005, rel=0.02)


def test_a_role_switch_forgets_the_old_roles_figures():
    m = LoadMeter()
    for n in (10, 20, 40):
        m.prefill.add(n, 0.5 + 0.1 * n)  # a decode worker's pickups: slow "prefill" per token
    for _ in range(12):
        m.observe_decode_step(4, 0.02)
    m.observe_transfer(1 << 20, 0.01, 0.02)
    before = m.report()
    assert before.prefill_tokens_per_s > 0 and before.decode_step_s > 0 and before.kv_bytes_per_s > 0
    m.forget()
    r = m.report()
    # 0 is "unmeasured": the router then prices the worker like its new pool's measured peers
    assert (r.prefill_tokens_per_s, r.prefill_overhead_s, r.decode_step_s, r.kv_bytes_per_s,
            r.handoff_overhead_s) == (0, 0, 0, 0, 0)
    for _ in range(LoadMeter.DECODE_WARMUP):  # cold steps of the new role are skipped again
        m.observe_decode_step(4, 1.0)
    assert m.report().decode_step_s == 0
