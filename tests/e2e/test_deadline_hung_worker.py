"""A request's deadline holds at the gateway even when its worker can no longer enforce it.

Workers end a request at its deadline themselves (the `Lifecycle` field of their request). A worker that hangs
(SIGSTOP: alive, connected, silent) cannot; before the gateway cut its relay at the deadline, the client waited
until the worker's registry entry lapsed (two heartbeat TTLs, here 20 s) and the move found no other worker.
Real `pdserve up --mode colocated` (one worker, tiny Llama, 30 ms a step), heartbeat TTL 10 s, `timeout` 2 s.
"""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from pdserve.services.up_process import UpProcess
from tests.e2e.conftest import NUM_BLOCKS, ROOT, metric, served_as_ck, wait_until

TIMEOUT_S = 2.0


def _record(up, log_id: str) -> dict:
    """The billing record (one JSON line of the pdserve.billing logger) of the request whose x-request-id (the
    log lines' id) is `log_id`."""
    found: list[dict] = []

    def seen() -> bool:
        found[:] = [json.loads(line[line.index("{"):]) for line in list(up.lines)
                    if " pdserve.billing" in line and log_id in line and "{" in line]
        return bool(found)

    assert wait_until(seen, 10), f"no billing record for {log_id}"
    assert len(found) == 1, found  # exactly one per client request
    return found[0]


@pytest.fixture(scope="module")
def up(tiny_llama, tmp_path_factory):
    model, _ = served_as_ck(tiny_llama, tmp_path_factory, "tenants: {}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "INFO", "PDSERVE_FAULT_STEP_DELAY_S": "0.03"}
    d = UpProcess(["--no-restart", "--model", str(model), "--num-gpu-blocks", str(NUM_BLOCKS), "--mode", "colocated",
                   "--workers", "1", "--heartbeat-ttl", "10"], env, 120)
    yield d
    d.stop()


def _body(stream: bool) -> dict:
    return {"model": "ck", "prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True,
            "stream": stream, "timeout": TIMEOUT_S}


@pytest.mark.parametrize("stream", [True, False])
def test_deadline_ends_the_request_when_its_worker_hangs(up, stream):
    pid = up.workers()[0]["pid"]
    t0 = time.monotonic()
    events, error = 0, None
    try:
        with httpx.Client(timeout=30) as c:
            if stream:
                with c.stream("POST", up.base_url + "/v1/completions", json=_body(True)) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            error = ev["error"]
                            break
                        events += 1
                        if events == 5:  # tokens are flowing: the worker hangs mid-stream
                            os.kill(pid, signal.SIGSTOP)
                            stopped = time.monotonic()
                rid = r.headers["x-request-id"]
            else:
                stopped = time.monotonic()
                os.kill(pid, signal.SIGSTOP)  # hung before it could answer anything
                r = c.post(up.base_url + "/v1/completions", json=_body(False))
                rid = r.headers["x-request-id"]
                assert r.status_code == 504, r.text
                error = r.json()["error"]
        waited = time.monotonic() - t0
        print(f"stream={stream}: error after {waited:.2f} s ({time.monotonic() - stopped:.2f} s after SIGSTOP): {error}")
        # as when a worker ends the request at its deadline: mid-stream the code names the state
        assert error is not None and error["type"] == "timeout_error", error
        assert error["code"] == ("timed_out" if stream else "timeout"), error
        assert waited <= TIMEOUT_S + 0.75, waited
        rec = _record(up, rid)
        assert rec["state"] == "TIMED_OUT", rec
        assert rec["emitted_tokens"] >= (5 if stream else 0), rec
    finally:
        os.kill(pid, signal.SIGCONT)
    # the worker, resumed, hears the abort: nothing stays held
    wm = up.workers()[0]["metrics_port"]
    assert wait_until(lambda: metric(wm, "pdserve_kv_blocks_in_use") == 0, 15)
