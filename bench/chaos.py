"""The fault matrix against a live `pdserve up --mode disagg` (1 prefill + 2 decode workers, a
second gateway process next to up's), one case after another on the same deployment (`up` restarts what a case
killed; each case starts once everything is ready again). Harness and definitions: pdserve/bench/chaos.py.

    python bench/chaos.py [--model builtin] [--cases all|kill-decode,...] [--rate 8] [--duration 8]
                          [--fault-at 3] [--storm 1000] [--heartbeat-ttl 2] [--step-delay 0.02]
                          [--json out.json]

With --lab, the link faults instead (pdserve/bench/chaos_lab.py), on a deployment over emulated hosts (pdserve/lab:
Redis, router, gateway and 1 prefill + 2 decode workers each in a network namespace, the worker links capped at
--link-rate; needs root):

    python bench/chaos.py --lab [--cases all|link-down-mid-transfer,loss-5pct,delay-spike-200ms,
                                 asymmetric-partition,router-redis-cut,decode-host-cut-10s] [--heartbeat-ttl 3]

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

LAB = {"rate": 4.0, "prompt_len": 96, "timeout": 15.0, "settle": 30.0, "heartbeat_ttl": 3.0}  # --lab's defaults where they differ

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
    ap.add_argument("--lab", action="store_true", help="the link faults, on emulated hosts (root)")
    ap.add_argument("--prefill", type=int, default=1, help="--lab: prefill hosts")
    ap.add_argument("--decode", type=int, default=2, help="--lab: decode hosts")
    ap.add_argument("--link-rate", default="40mbit", help="--lab: every worker host's link (a rate: the delay spike "
                    "holds the packets in its token bucket)")
    ap.add_argument("--prompt-len", type=int, help=f"tokens per prompt (default 40; --lab {LAB['prompt_len']}: "
                    "~0.8 MB of KV each, ~0.16 s over a 40 Mbit/s link, so a fault meets pulls in flight)")
    ap.add_argument("--timeout", type=float, help=f"each request's deadline, s (default 30; --lab {LAB['timeout']})")
    ap.add_argument("--settle", type=float, help=f"s to wait for blocks/pinned/reservations to read 0 (default 20; "
                    f"--lab {LAB['settle']}: a lease cut off from its puller expires after the workers' "
                    "--lease-ttl, 10 s)")
    ap.add_argument("--rate", type=float, help=f"requests/s, open loop (Poisson; default 8, --lab {LAB['rate']})")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of load per case")
    ap.add_argument("--fault-at", type=float, default=3.0, help="seconds into the load")
    ap.add_argument("--storm", type=int, default=1000, help="abort storm: streams")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--heartbeat-ttl", type=float,
                    help=f"the router's and workers' heartbeat TTL, s (default 2; --lab {LAB['heartbeat_ttl']})")
    ap.add_argument("--step-delay", type=float, default=0.02,
                    help="s added to every engine step (PDSERVE_FAULT_STEP_DELAY_S): the small model's streams then "
                         "last as long as a real model's (~20 ms a decode step), so faults find streams in flight")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()

    def pick(given, lab, one):  # what was given, else --lab's default or the one-host one
        return given if given is not None else (lab if a.lab else one)

    a.rate, prompt_len = pick(a.rate, LAB["rate"], 8.0), pick(a.prompt_len, LAB["prompt_len"], 40)
    timeout, settle = pick(a.timeout, LAB["timeout"], 30.0), pick(a.settle, LAB["settle"], 20.0)
    a.heartbeat_ttl = pick(a.heartbeat_ttl, LAB["heartbeat_ttl"], 2.0)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if a.step_delay:
        env["PDSERVE_FAULT_STEP_DELAY_S"] = str(a.step_delay)
    served = "builtin" if a.model == "builtin" else os.path.basename(os.path.normpath(a.model))
    t0 = time.time()
    if a.lab:
        from pdserve.bench.chaos_lab import LAB_CASES
        cases = LAB_CASES if a.cases == "all" else tuple(a.cases.split(","))
        dep, close = _lab(a, env)
    else:
        cases = CASES if a.cases == "all" else tuple(a.cases.split(","))
        dep = ChaosDeployment(a.model, served, env, heartbeat_ttl=a.heartbeat_ttl)
        close = dep.stop
    rows = []
    print(f"CPU: {cpu_model()}", flush=True)
    print(HEAD)
    print("|" + " --- |" * (HEAD.count("|") - 1))
    try:
        for i, case in enumerate(cases):
            r = run_case(dep, case, rate=a.rate, duration=a.duration, fault_at=a.fault_at, storm=a.storm, seed=i,
                         max_tokens=a.max_tokens, timeout_s=timeout, prompt_len=prompt_len, settle_timeout=settle)
            rows.append(r.row())
            print(row(r), flush=True)
            print(f"<!-- {r.case}: longest request {r.longest_s:.2f} s, deadline {r.deadline_s:.0f} s, "
                  f"{r.past_deadline} past it; released in {r.settle_s} s"
                  + (f"; the fault: {r.fault_note}" if r.fault_note else "") + " -->", flush=True)
            if r.diverged:
                print(f"<!-- {r.case}: greedy re-runs that differ: {r.diverged} -->", flush=True)
            if r.samples:
                print(f"<!-- {r.case}: first error of each kind {r.samples} -->", flush=True)
            if r.reasons:
                print(f"<!-- {r.case}: gateway FAILED reasons {r.reasons} -->", flush=True)
    finally:
        close()
    where = (f"emulated hosts ({a.prefill} prefill + {a.decode} decode, worker links {a.link_rate}), heartbeat TTL "
             f"{dep.ttl} s" if a.lab else f"heartbeat TTL {a.heartbeat_ttl} s")
    print(f"model {a.model}, {where}, {a.rate} req/s for {a.duration} s per case, fault at {a.fault_at} s, "
          f"{prompt_len}-token prompts, {a.max_tokens} tokens per request, deadline {timeout:.0f} s, step delay "
          f"{a.step_delay} s; {time.time() - t0:.0f} s in all; CPU: {cpu_model()}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


def _lab(a, env: dict):
    """A started lab deployment for the link cases, and the function that closes it."""
    from pdserve.bench.chaos_lab import LabChaosDeployment
    from pdserve.lab.cluster import LabCluster, LabSpec
    from pdserve.lab.netns import Link
    keep = ("PYTHONPATH", "PDSERVE_FAULT_STEP_DELAY_S")
    spec = LabSpec(model=a.model, prefill=a.prefill, decode=a.decode, link=Link.parse(a.link_rate),
                   heartbeat_ttl=a.heartbeat_ttl,
                   # --lease-ttl 10 as the one-host matrix: KV pinned for a puller that a partition cut off is
                   # freed by its lease's expiry, which the case waits out (--settle)
                   engine_args=("--num-gpu-blocks", "256", "--threads", "1", "--lease-ttl", "10"),
                   env={**{k: env[k] for k in keep if k in env}, "PDSERVE_LOG_LEVEL": "INFO"})  # billing lines
    cluster = LabCluster(spec)
    try:
        cluster.start()
    except BaseException:
        cluster.close()
        raise
    return LabChaosDeployment(cluster), cluster.close


if __name__ == "__main__":
    main()
