"""The fault matrix (issue 19, item 5) against a live `pdserve up --mode disagg` (1 prefill + 2 decode workers, a
second gateway process next to up's), one case after another on the same deployment (`up` restarts what a case
killed; each case starts once everything is ready again). Harness and definitions: pdserve/bench/chaos.py.

    python bench/chaos.py [--model builtin] [--cases all|kill-decode,...] [--rate 8] [--duration 8]
                          [--fault-at 3] [--storm 1000] [--heartbeat-ttl 2] [--step-delay 0.02]
                          [--json out.json]

Prints one markdown row per case (the table in docs/reliability.md) and the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.chaos import CASES, ChaosDeployment, cpu_model, run_case  # noqa: E402

HEAD = ("| case | sent | finished | failed | cancelled | migrated | blocks / pinned / reservations left | "
        "records: exactly one / missing / duplicated | longest wait for an error | longest stall | recovery | "
        "moved streams: finished / greedy = uninterrupted (control) | errors |")


def row(r) -> str:
    def s(x):
        return "?" if x is None else str(x)
    return (f"| {r.case} | {r.sent} | {r.finished} | {r.failed} | {r.cancelled} | {r.migrated} | "
            f"{s(r.blocks_left)} / {s(r.pinned_left)} / {s(r.reservations_left)} | "
            f"{r.records_one} / {r.records_missing} / {r.records_dup} | {r.max_error_wait_s:.2f} s | "
            f"{r.max_stall_s:.2f} s | {r.recovery_s:.2f} s | "
            f"{r.migrated_finished} of {r.migrated_streams} / {r.greedy_equal} ({r.control_equal}) | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(r.errors.items())) or '-'}"
            + (f" ({r.early_failures} before the fault)" if r.early_failures else "") + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--cases", default="all")
    ap.add_argument("--rate", type=float, default=8.0, help="requests/s, open loop (Poisson)")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of load per case")
    ap.add_argument("--fault-at", type=float, default=3.0, help="seconds into the load")
    ap.add_argument("--storm", type=int, default=1000, help="abort storm: streams")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--heartbeat-ttl", type=float, default=2.0)
    ap.add_argument("--step-delay", type=float, default=0.02,
                    help="s added to every engine step (PDSERVE_FAULT_STEP_DELAY_S): the small model's streams then "
                         "last as long as a real model's (~20 ms a decode step), so faults find streams in flight")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    cases = CASES if a.cases == "all" else tuple(a.cases.split(","))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if a.step_delay:
        env["PDSERVE_FAULT_STEP_DELAY_S"] = str(a.step_delay)
    served = "builtin" if a.model == "builtin" else os.path.basename(os.path.normpath(a.model))
    t0 = time.time()
    dep = ChaosDeployment(a.model, served, env, heartbeat_ttl=a.heartbeat_ttl)
    rows = []
    print(f"CPU: {cpu_model()}", flush=True)
    print(HEAD)
    print("|" + " --- |" * (HEAD.count("|") - 1))
    try:
        for i, case in enumerate(cases):
            r = run_case(dep, case, rate=a.rate, duration=a.duration, fault_at=a.fault_at, storm=a.storm, seed=i,
                         max_tokens=a.max_tokens)
            rows.append(r.row())
            print(row(r), flush=True)
            if r.diverged:
                print(f"<!-- {r.case}: greedy re-runs that differ: {r.diverged} -->", flush=True)
            if r.samples:
                print(f"<!-- {r.case}: first error of each kind {r.samples} -->", flush=True)
            if r.reasons:
                print(f"<!-- {r.case}: gateway FAILED reasons {r.reasons} -->", flush=True)
    finally:
        dep.stop()
    print(f"model {a.model}, heartbeat TTL {a.heartbeat_ttl} s, {a.rate} req/s for {a.duration} s per case, fault at "
          f"{a.fault_at} s, {a.max_tokens} tokens per request, step delay {a.step_delay} s; {time.time() - t0:.0f} s in all; CPU: {cpu_model()}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
