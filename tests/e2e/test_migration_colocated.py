"""Mid-stream migration between two `both` workers (`pdserve up --mode colocated --workers 2`): SIGKILL of the worker
serving a greedy stream after some tokens went out; the stream goes on on the other worker and its text equals the
offline engine's uninterrupted run (tests/e2e/test_migration.py has the disaggregated cases)."""
from __future__ import annotations

import os
import signal

import pytest

from pdserve.services.up_process import UpProcess
from tests.e2e.conftest import NUM_BLOCKS, ROOT, metric, served_as_ck, wait_until
from tests.e2e.test_migration import STEP_DELAY_S, Stream, _pid, _record, _reference


@pytest.fixture(scope="module")
def up(tiny_llama, tmp_path_factory):
    model, _ = served_as_ck(tiny_llama, tmp_path_factory, "tenants: {}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "INFO",
           "PDSERVE_FAULT_STEP_DELAY_S": str(STEP_DELAY_S)}
    d = UpProcess(["--no-restart", "--model", str(model), "--num-gpu-blocks", str(NUM_BLOCKS), "--mode", "colocated",
                   "--workers", "2"], env, 120)
    yield d
    d.stop()


def test_sigkill_of_a_colocated_worker_migrates(up, tiny_llama):
    want = _reference(tiny_llama, max_tokens=40, temperature=0, frequency_penalty=0.5)
    s = Stream(up, max_tokens=40, temperature=0, frequency_penalty=0.5)
    s.read(10)
    assert s.route["mode"] == "colocated", s.route
    os.kill(_pid(up, s.route["worker"]), signal.SIGKILL)
    s.read()
    assert s.error is None and s.done, s.error
    assert s.text == want, (s.text, want)  # penalties saw the tokens sent before the move
    assert s.usage["completion_tokens"] == 40
    rec = _record(up, s.id)
    assert rec["state"] == "FINISHED" and rec["migrations"] == 1 and rec["recomputed_tokens"] > 0, rec
    assert metric(up.port, "pdserve_migrations_total", '{reason="unavailable"}') == 1
    survivor = next(p for p in up.workers() if p["worker_id"] != s.route["worker"])
    assert wait_until(lambda: metric(survivor["metrics_port"], "pdserve_kv_blocks_in_use") == 0, 15)
