"""The planner's model against the deployment it plans, and its decisions under a steady load and a step.

`pdserve up --mode disagg --planner --planner-interval 5 --min-decode 1 --max-decode 2 --max-prefill 2` (built-in
model) under open loops from `pdserve bench run` (32-token prompts, 96-token outputs), one phase of constant rate
after another; the planner's last decision (what `pdserve status` shows: status.gather) read every 0.5 s. Per
phase: the decisions, their spacing, each pool's changes, observed vs simulated (raw, at the counts in place) vs
corrected p90s, and the planner's own step time; for a step between phases, how many intervals after it the
planner sized for the new rate and, if it changed a pool, changed it. Prints the CPU and one JSON object.

    python bench/planner_model.py --phases 8:90            # the constant-load scenario
    python bench/planner_model.py --phases 2:40,8:45       # the step
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

UP_ARGS = ["--model", "builtin", "--num-gpu-blocks", "256", "--mode", "disagg", "--planner", "--min-decode", "1",
           "--max-decode", "2", "--min-prefill", "1", "--max-prefill", "2"]


def _status() -> dict | None:
    from pdserve.services.status import gather
    a = argparse.Namespace(url=None, redis_url=None, model=None, api_key=None, internal_token_file=None,
                           redis_password_file=None, redis_ca_file=None)
    return gather(a)


def run(phases: list[tuple[float, float]], interval: float = 5.0, out: Path | None = None,
        up_args: list[str] | None = None) -> dict:
    """Run the phases against a fresh `pdserve up`; every distinct decision, the phases' start times, the log."""
    from pdserve.services.up_process import UpProcess
    out = out or Path(tempfile.mkdtemp(prefix="planner-model-"))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), PDSERVE_LOG_LEVEL="INFO",
               PDSERVE_STATE_DIR=str(out / "state"))
    os.environ["PDSERVE_STATE_DIR"] = env["PDSERVE_STATE_DIR"]   # status.gather finds this `up`
    up = UpProcess([*(up_args or UP_ARGS), "--planner-interval", str(interval)], env, ready_timeout=300)
    decisions: dict[float, dict] = {}
    starts, benches = [], []
    try:
        for i, (rate, seconds) in enumerate(phases):
            starts.append(time.time())
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve", "bench", "run", "--base-url", up.base_url, "--rate", str(rate),
                 "--duration", str(seconds), "--prompt-len", "32", "--output-len", "96", "--out", str(out / f"b{i}"),
                 "--no-progress", "--seed", str(i), "--no-records"], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)
            while proc.poll() is None:
                st = _status()
                last = ((st or {}).get("planner") or {}).get("last")
                if last:
                    decisions[last["time"]] = last
                time.sleep(0.5)
            end = time.time()
            try:  # the open loop's own start: bench's start-up and its two cold-start requests come before it
                start = end - json.loads((out / f"b{i}" / "results.json").read_text())["points"][0]["wall_s"]
            except (OSError, KeyError, IndexError, ValueError):
                start = starts[-1]
            benches.append({"rate": rate, "seconds": seconds, "rc": proc.returncode, "start": max(start, starts[-1]),
                            "end": end, "output": proc.stdout.read()[-2000:]})
    finally:
        up.stop()
    return {"interval_s": interval, "phases": phases, "starts": starts, "benches": benches,
            "decisions": [decisions[t] for t in sorted(decisions)], "log": up.lines}


def _seen(d: dict, slo: str) -> float | None:
    """The observed p90 the model was compared with (pooled over the intervals at the same counts)."""
    return d.get(f"compared_{slo}_p90", d.get(f"observed_{slo}_p90"))


def _ratio(d: dict, slo: str) -> float | None:
    obs, cor = _seen(d, slo), d.get(f"corrected_{slo}_p90")
    return cor / obs if obs and cor else None


def summarize(res: dict) -> dict:
    iv, ds = res["interval_s"], res["decisions"]
    starts = [b.get("start", t) for b, t in zip(res["benches"], res["starts"])]
    ends = [b["end"] for b in res["benches"]]   # a phase's decisions: up to its load's end
    gaps = [b["time"] - a["time"] for a, b in zip(ds, ds[1:])]
    phases, checked = [], []
    for (rate, _), t0, t1 in zip(res["phases"], starts, ends):
        # decisions whose whole interval lies in the phase
        mine = [d for d in ds if t0 + iv <= d["time"] < t1]
        prev = [d for d in ds if d["time"] < t0]
        counts0 = {p["pool"]: p["desired"] for p in prev[-1]["pools"]} if prev else None
        changes = [(round(d["time"] - t0, 1), p["pool"], p["current"], p["desired"]) for d in mine
                   for p in d["pools"] if p["action"] != "hold"]
        # where the model was checked against the counts in place (3 learned intervals since they changed, what
        # a shrink waits for: correction.py) - the band is what the model answers for once it acts on it
        late = [d for d in mine if d.get("correction_checked", 0) >= 3]
        checked += late
        band = {slo: [r for r in (_ratio(d, slo) for d in late) if r is not None] for slo in ("ttft", "tpot")}
        raw = {slo: [d[f"simulated_{slo}_p90"] / _seen(d, slo) for d in late
                     if d.get(f"simulated_{slo}_p90") and _seen(d, slo)] for slo in ("ttft", "tpot")}
        sized = next((d for d in ds if d["time"] >= t0 and d["forecast_rate"] >= 0.75 * rate), None)
        changed = next((d for d in ds if d["time"] >= t0 and any(p["action"] != "hold" for p in d["pools"])), None)
        phases.append({
            "rate": rate, "decisions": len(mine), "checked_decisions": len(late), "counts_before": counts0, "changes": changes,
            "corrected_over_observed_median": {k: statistics.median(v) if v else None for k, v in band.items()},
            "within_25pct": {k: (sum(abs(x - 1) <= 0.25 for x in v), len(v)) for k, v in band.items()},
            "raw_over_observed_median": {k: statistics.median(v) if v else None for k, v in raw.items()},
            "correction_last": {k: (mine[-1].get(f"correction_{k}") if mine else None) for k in ("ttft", "tpot")},
            "sized_for_rate_after_intervals": None if sized is None else round((sized["time"] - t0) / iv, 1),
            "first_change_after_intervals": None if changed is None else round((changed["time"] - t0) / iv, 1),
            "decide_s_max": max((d.get("decide_s") or 0.0 for d in mine), default=None),
            "stale_decisions": sum(bool(d.get("model_stale")) for d in mine)})
    every = {slo: [r for r in (_ratio(d, slo) for d in checked) if r is not None] for slo in ("ttft", "tpot")}
    return {"interval_s": iv, "decisions": len(ds), "gap_s_max": max(gaps, default=None),
            "checked_decisions": len(checked),
            "corrected_over_observed_median": {k: statistics.median(v) if v else None for k, v in every.items()},
            "gap_s_median": statistics.median(gaps) if gaps else None, "phases": phases,
            "benches_ok": all(b["rc"] == 0 for b in res["benches"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", default="8:90", help="RATE:SECONDS,... (open loop, one after another)")
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--out", default=None, help="write the decisions and the summary here (JSON)")
    a = ap.parse_args()
    phases = [(float(r), float(s)) for r, s in (p.split(":") for p in a.phases.split(","))]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    res = run(phases, a.interval)
    summary = {"cpu": cpu, "cores": os.cpu_count(), "load_avg": os.getloadavg(), "phases_arg": a.phases,
               **summarize(res)}
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "decisions": res["decisions"]}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
