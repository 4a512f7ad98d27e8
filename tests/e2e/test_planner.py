"""`pdserve up --mode disagg --planner` under a real load step from `pdserve bench`: the planner adds a decode
worker, the registry and the router use it, and once the load stops the planner drains it (SIGTERM: deregister,
finish in-flight) and it exits, with no request failed; `pdserve status --json` shows each change.

The TPOT SLO is set below what this box reaches under any load (2 ms), so the decision to grow is certain (the
measured violation: guard.py rule 2, or the model itself finding one decode replica short); which count the model
picks for a given load is tests/planner/test_policy_sim.py's subject. Polling uses the status code in-process
(`status.gather`, what the CLI runs); the CLI itself is run at the two states the test waits for.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

from pdserve.planner.status import gather
from pdserve.services.up_process import UpProcess
from tests.e2e.conftest import ROOT, samples


def _env(state_dir) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env["PDSERVE_LOG_LEVEL"] = "INFO"  # the planner's decision lines
    env["PDSERVE_STATE_DIR"] = str(state_dir)
    return env


def _status_cli(env) -> dict:
    out = subprocess.run([sys.executable, "-m", "pdserve", "status", "--json"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _status(env) -> dict:
    # `env` for symmetry with _status_cli: PDSERVE_STATE_DIR is set in this process too (monkeypatch)
    a = argparse.Namespace(url=None, redis_url=None, model=None, api_key=None, internal_token_file=None,
                           redis_password_file=None, redis_ca_file=None)
    return gather(a)


def _decode(st: dict) -> list[dict]:
    return [w for w in st["workers"] if w["role"] == "decode"]


def _served(port: int) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return sum(samples(r.read().decode(), "pdserve_engine_requests_terminal_total"))
    except OSError:
        return 0.0


def test_planner_grows_decode_under_load_and_drains_after(tmp_path, monkeypatch):
    env = _env(tmp_path / "state")
    monkeypatch.setenv("PDSERVE_STATE_DIR", env["PDSERVE_STATE_DIR"])
    up = UpProcess(["--model", "builtin", "--num-gpu-blocks", "256", "--mode", "disagg", "--planner",
                    "--planner-interval", "5", "--min-decode", "1", "--max-decode", "2", "--min-prefill", "1",
                    "--max-prefill", "1", "--slo-tpot", "0.002", "--slo-ttft", "5", "--scale-down-cooldown", "5",
                    "--planner-window", "2"], env, ready_timeout=150)
    bench = None
    try:
        first = _status(env)
        assert [w["role"] for w in first["workers"]] == ["prefill", "decode"]
        assert all({"id", "role", "healthy"} <= set(w) and w["healthy"] for w in first["workers"])
        original = _decode(first)[0]["id"]
        bench = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "bench", "run", "--base-url", up.base_url, "--rate", "3",
             "--duration", "45", "--prompt-len", "32", "--output-len", "24", "--out", str(tmp_path / "bench"),
             "--no-progress", "--seed", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        # 1. the planner adds a decode worker; it registers (healthy, serving) while the load runs
        added = None
        end = time.monotonic() + 80
        while time.monotonic() < end and bench.poll() is None:
            st = _status(env)
            serving = [w for w in _decode(st) if w["healthy"]]
            if len(serving) == 2:
                added = next(w for w in serving if w["id"] != original)
                assert added["state"] == "serving" and added["pid"] and added["metrics_port"]
                break
            time.sleep(1.0)
        assert added is not None, "no second decode worker registered during the load:\n" + "".join(up.lines[-40:])
        cli = _status_cli(env)  # the CLI shows the change
        assert cli["pools"]["decode"]["replicas"] == 2 and cli["pools"]["decode"]["healthy"] == 2
        ups = [c for c in cli["planner"]["changes"] for p in c["pools"]
               if p["pool"] == "decode" and p["action"] == "up"]
        assert ups and all(c["connector"] == "local" and not c["dry_run"] for c in ups)

        # 2. the router sends it work: its engine finishes requests while the load lasts
        served = 0.0
        while bench.poll() is None:
            served = max(served, _served(added["metrics_port"]))
            time.sleep(1.0)
        served = max(served, _served(added["metrics_port"]))
        out = bench.communicate()[0]
        assert bench.returncode == 0, out
        assert served > 0, "the added decode worker finished no request"

        # 3. load stopped: the planner drains it and it exits; the original stays
        shrunk = None
        end = time.monotonic() + 90
        while time.monotonic() < end:
            st = _status(env)
            if [w["id"] for w in _decode(st)] == [original]:
                shrunk = st
                break
            time.sleep(1.0)
        assert shrunk is not None, "the added worker was not removed:\n" + "".join(up.lines[-40:])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(added["pid"], 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"drained worker pid {added['pid']} still running")
        cli = _status_cli(env)
        assert cli["pools"]["decode"] == {"replicas": 1, "healthy": 1, "draining": 0}
        downs = [(c, p) for c in cli["planner"]["changes"] for p in c["pools"]
                 if p["pool"] == "decode" and p["action"] == "down"]
        assert downs and all(p["reason"] for _, p in downs)
        # most recent first: the shrink came after the growth
        assert cli["planner"]["changes"].index(downs[0][0]) < cli["planner"]["changes"].index(ups[0])
        assert all(p["current"] - p["desired"] == 1 for _, p in downs)  # one step per interval

        # the gateway's /status (`pdserve status --url`) says the same, the planner's record included
        gw = gather(argparse.Namespace(url=up.base_url, redis_url=None, model=None, api_key=None,
                                       internal_token_file=None, redis_password_file=None, redis_ca_file=None))
        assert sorted((w["id"], w["role"], w["healthy"]) for w in gw["workers"]) == sorted(
            (w["id"], w["role"], True) for w in cli["workers"])
        assert gw["planner"]["changes"][0]["time"] >= downs[0][0]["time"]

        # 4. no request failed: every bench record ok, and the gateway counted no other terminal state
        res = json.loads((tmp_path / "bench" / "results.json").read_text())
        recs = res["points"][0]["records"]
        assert recs and all(r["ok"] for r in recs), [r["error"] for r in recs if not r["ok"]][:5]
        with urllib.request.urlopen(up.base_url + "/metrics", timeout=5) as r:
            page = r.read().decode()
        total = sum(samples(page, "pdserve_requests_terminal_total"))
        assert total >= len(recs)
        assert sum(samples(page, "pdserve_requests_terminal_total", '{state="FINISHED"}')) == total
        # the decisions were logged with their reasons
        log = "".join(up.lines)
        assert "planner: prefill 1->1" in log and "decode 1->2 [up:" in log and "decode 2->1 [down:" in log
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()
            bench.wait()
        up.stop()
