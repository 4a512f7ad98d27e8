"""Role switch duration on this machine: `pdserve up --model builtin --mode disagg` (1 prefill + 2 decode), a light
closed loop of streaming clients, and one decode worker switched decode -> prefill -> decode N times through its
SwitchRole RPC (what `pdserve worker-role` and the planner call).

Per switch it reports the RPC's own figure (its arrival -> registered in the new role, drain included), the
caller's round trip, and the time from the RPC's return until a fresh prompt (no cached prefix to draw it
elsewhere) is served with the worker in its new role (the routers' view refresh and placement). Every request's
outcome is counted: a failed one is a defect.

    PYTHONPATH=. python bench/role_switch.py --switches 6 --clients 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.services.up_process import UpProcess  # noqa: E402


def _stream(c: httpx.Client, model: str, prompt: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    with c.stream("POST", "/v1/completions", json=body, headers={"x-pdserve-debug": "route"}) as r:
        last = r.headers.get("x-pdserve-route", "").split(" | ")[-1]
        route = dict(kv.split("=", 1) for kv in last.split(";") if "=" in kv)
        ok = r.status_code == 200 and not any('"error"' in line for line in r.iter_lines())
    return (200 if ok else 599), route


def _loop(base: str, model: str, stop: threading.Event, codes: list) -> None:
    with httpx.Client(base_url=base, timeout=60) as c:
        i = 0
        while not stop.is_set():
            codes.append(_stream(c, model, ["hello there", "tell me a story", "what is two plus two"][i % 3])[0])
            i += 1


def _placed_as(base: str, model: str, role: str, wid: str, timeout_s: float = 20.0) -> float | None:
    t0 = time.monotonic()
    with httpx.Client(base_url=base, timeout=60) as c:
        while time.monotonic() - t0 < timeout_s:
            if _stream(c, model, f"{os.urandom(6).hex()} fresh")[1].get(role) == wid:
                return time.monotonic() - t0
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--switches", type=int, default=6)
    ap.add_argument("--clients", type=int, default=2)
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "WARNING"}
    up = UpProcess(["--model", "builtin", "--mode", "disagg", "--prefill", "1", "--decode", "2"], env, 180)
    try:
        from pdserve.services.grpc_util import configure
        from pdserve.services.internal_security import InternalSecurity
        from pdserve.services.role_cli import switch
        configure(InternalSecurity.from_files(up.info["internal_token_file"]))
        victim = up.workers("decode")[1]
        addr, wid, model = f"127.0.0.1:{victim['port']}", victim["worker_id"], up.info["model"]
        stop, codes = threading.Event(), []
        threads = [threading.Thread(target=_loop, args=(up.base_url, model, stop, codes)) for _ in range(a.clients)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        rows = []
        for k in range(a.switches):
            dst = "prefill" if k % 2 == 0 else "decode"
            t0 = time.monotonic()
            r = asyncio.run(switch(addr, dst))
            rtt = time.monotonic() - t0
            served = _placed_as(up.base_url, model, dst, wid)
            rows.append({"to": dst, "switched": r.switched, "rpc_s": round(r.seconds, 4), "drain_s": round(r.drain_s, 4),
                         "held": r.drained_requests, "round_trip_s": round(rtt, 4),
                         "first_served_after_s": None if served is None else round(served, 3)})
            print(json.dumps(rows[-1]), flush=True)
        stop.set()
        for t in threads:
            t.join()
        secs = [x["rpc_s"] for x in rows]
        served = [x["first_served_after_s"] for x in rows if x["first_served_after_s"] is not None]
        print(json.dumps({"switches": len(rows), "all_switched": all(x["switched"] for x in rows),
                          "rpc_s_median": statistics.median(secs), "rpc_s_max": max(secs),
                          "first_served_after_s_median": statistics.median(served) if served else None,
                          "first_served_after_s_max": max(served) if served else None,
                          "requests": len(codes), "failed": sum(c != 200 for c in codes)}))
    finally:
        up.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
