"""After a decode worker is SIGKILLed mid-stream, how many of the next requests are placed on it?

`pdserve up --mode disagg --no-restart` (builtin model, 1 prefill + 2 decode workers, heartbeat TTL 3 s, steps
slowed to 30 ms): a 60-token stream is read for 5 events, its decode worker SIGKILLed, the stream read to its end
(it migrates), then 8 short requests are sent one after another, and the script counts those whose
`x-pdserve-route` names the dead worker (the registry lists it until its TTL lapses). docs/reliability.md,
"A dead worker is skipped at once".

    python bench/dead_worker_placement.py [ROOT]    # ROOT: the pdserve source tree to run (default: this one)
"""
import os
import signal
import sys
import time
from pathlib import Path

import httpx

root = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1])
sys.path.insert(0, root)
from pdserve.services.up_process import UpProcess  # noqa: E402

env = {**os.environ, "PYTHONPATH": root, "PYTHONDONTWRITEBYTECODE": "1", "PDSERVE_FAULT_STEP_DELAY_S": "0.03"}
up = UpProcess(["--no-restart", "--model", "builtin", "--mode", "disagg", "--prefill", "1", "--decode", "2",
                "--heartbeat-ttl", "3"], env, 180)
try:
    def route(r):
        return dict(kv.split("=", 1) for kv in r.headers["x-pdserve-route"].split(" | ")[0].split(";"))
    body = {"model": "builtin", "prompt": "the quick brown fox", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", up.base_url + "/v1/completions", json=body, headers={"x-pdserve-debug": "route"},
                      timeout=60) as r:
        dead = route(r)["decode"]
        it = r.iter_lines()
        n = 0
        for line in it:
            if line.startswith("data: {"):
                n += 1
                if n == 5:
                    pid = next(p["pid"] for p in up.workers() if p["worker_id"] == dead)
                    os.kill(pid, signal.SIGKILL)
                    t_kill = time.monotonic()
                    break
        for line in it:
            pass
    hits = 0
    for i in range(8):
        rr = httpx.post(up.base_url + "/v1/completions", headers={"x-pdserve-debug": "route"}, timeout=60,
                        json={"model": "builtin", "prompt": f"request {i}", "max_tokens": 2, "temperature": 0})
        hits += route(rr).get("decode") == dead
    print(f"CPU: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{root}: {hits} of 8 requests sent within {time.monotonic() - t_kill:.2f} s of the kill placed on the dead decode worker")
finally:
    up.stop()
