"""`pdserve planner` as its own process (what the chart's pod runs), read-only connector and --dry-run: it logs
each decision with its reason, serves its metrics, stores the decision in Redis, and exits 0 on SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import redis

from pdserve.services.ports import free_port
from tests.e2e.conftest import ROOT, samples


def test_planner_process_dry_run():
    model = f"planner-{uuid.uuid4().hex[:8]}"
    mport, page_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "INFO"}
    p = subprocess.Popen([sys.executable, "-m", "pdserve", "planner", "--connector", "registry", "--dry-run",
                          "--served-model-name", model, "--metrics-url", f"http://127.0.0.1:{page_port}/metrics",
                          "--metrics-port", str(mport), "--host", "127.0.0.1", "--planner-interval", "1"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    r = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        stored = None
        end = time.monotonic() + 90
        while time.monotonic() < end and p.poll() is None and stored is None:
            stored = r.get(f"pdserve:{model}:planner:last")
            time.sleep(0.5)
        assert stored is not None, p.communicate(timeout=30)[0] if p.poll() is not None else "no decision stored"
        d = json.loads(json.loads(stored)["decision"])
        # no workers registered, no traffic: the minimum (1 each) is what a dry run would ask for
        assert d["dry_run"] and not d["applied"] and d["connector"] == "registry"
        assert [(x["pool"], x["current"], x["desired"], x["action"]) for x in d["pools"]] == [
            ("prefill", 0, 1, "up"), ("decode", 0, 1, "up")]
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as resp:
            page = resp.read().decode()
        assert samples(page, "pdserve_planner_dry_run") == [1.0]
        assert samples(page, "pdserve_planner_desired_replicas", '{pool="decode"}') == [1.0]
        assert sum(samples(page, "pdserve_planner_errors_total")) == 0  # an unreachable page is a warning only
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=30)[0]
        assert p.returncode == 0, out
        assert "planner (dry run): prefill 0->1 [up:" in out and f"scrape http://127.0.0.1:{page_port}" in out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        r.delete(f"pdserve:{model}:planner:last", f"pdserve:{model}:planner:changes")
        r.close()
