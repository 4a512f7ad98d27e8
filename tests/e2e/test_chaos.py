"""The CI-sized subset of the fault matrix (the whole matrix: `python bench/chaos.py`, figures in
docs/reliability.md). One real `pdserve up --mode disagg` (Redis, router, 1 prefill + 2 decode workers, gateway;
tiny Llama) plus a second gateway; per case, open-loop load over both gateways and a fault at a fixed time:

- 0 KV blocks in use, 0 pinned and 0 reservations afterwards;
- exactly one usage record per request (by its x-request-id, from the gateways' billing lines), also for the
  requests in flight on a SIGKILLed gateway replica;
- no client waits more than 2 heartbeat TTLs for its error.
"""
from __future__ import annotations

import pytest

from pdserve.bench.chaos import ChaosDeployment, run_case
from tests.e2e.conftest import _env, served_as_ck

TTL = 2.0


@pytest.fixture(scope="module")
def dep(tiny_llama, tmp_path_factory):
    model, _ = served_as_ck(tiny_llama, tmp_path_factory, "tenants: {}\n")
    env = _env()
    env["PDSERVE_LOG_LEVEL"] = "INFO"  # the billing lines are INFO
    # every engine step >= 10 ms: a 48-token stream of the tiny model lasts ~0.5 s, so a fault finds streams in
    # flight (undelayed they last milliseconds and a kill hits none)
    env["PDSERVE_FAULT_STEP_DELAY_S"] = "0.01"
    d = ChaosDeployment(str(model), "ck", env, heartbeat_ttl=TTL,
                        extra=("--num-gpu-blocks", "256", "--threads", "1"),
                        log_dir=tmp_path_factory.mktemp("chaos"))
    yield d
    d.stop()


# the abort storm runs in CI as tests/e2e/test_abort_storm.py (120 streams); bench/chaos.py runs 1,000
# kill-gateway: the SIGKILLed replica's in-flight requests get their usage records from the other replica or its
# restarted self (gateway/usage_ledger.py)
@pytest.mark.parametrize("case", ["kill-decode", "partition-decode", "kill-gateway"])
def test_fault_leaves_nothing_behind(dep, case):
    r = run_case(dep, case, rate=6.0, duration=3.0, fault_at=1.0, storm=60, settle_timeout=15.0, max_tokens=48,
                 greedy_check=False)  # the migration tests assert what the re-runs measure
    print(r.row())
    assert r.sent > 0
    assert (r.blocks_left, r.pinned_left, r.reservations_left) == (0, 0, 0), r
    # every answered request has exactly one record, none has two (refused: no gateway got it; unanswered: its
    # gateway died before its response headers, admitted or not)
    assert r.records_missing == 0 and r.records_dup == 0, r
    assert r.records_one >= r.sent - r.refused - r.unanswered, r
    assert r.finished + r.failed + r.cancelled == r.sent
    assert r.max_error_wait_s <= 2 * TTL, r
    if case == "abort-storm":
        assert r.cancelled > 0
    else:
        assert r.finished > 0  # the deployment served through (or after) the fault
