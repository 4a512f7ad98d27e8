"""Role switching vs static P:D splits vs colocated, for real: `pdserve up --model builtin` with 4 workers, the
phase-shift trace (pdserve/sim/shift_trace.py; here `REAL_PHASES`, short and light enough for a small shared CPU)
replayed open loop by `pdserve bench`'s load generator, once per deployment:

- static: `--mode disagg --prefill P --decode 4-P` for P = 1..3 (the best chosen in hindsight by goodput);
- colocated: `--mode colocated --workers 4`;
- switching: starts at 2P+2D; every `--interval` s the controller (the simulator's, planner/switch_control.py: the split
  the last interval's arrivals ask for by `--sizing`, confirmed over `--confirm` intervals, the cost model from
  `--costs`) moves
  workers by their SwitchRole RPC (what `pdserve worker-role` and the planner call). Per switch: decision -> the RPC
  returned (the worker registered in its new role; routers see it at their next view refresh, <= 0.2 s).

Goodput (requests meeting both SLOs per second) and attainment, overall and per phase; every request's outcome is
counted, failures by their error (an overloaded split's admission rejections and timeouts are the deployment
answering as designed; any other error is a defect).

    PYTHONPATH=. python bench/role_switch_goodput.py --costs sim-costs.json [--only switching,static2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.client import LoadGen, Target  # noqa: E402
from pdserve.bench.metrics import SLO, summarize  # noqa: E402
from pdserve.planner.switch_control import PoolShape, pool_work, split_for, split_needed  # noqa: E402
from pdserve.services.up_process import UpProcess  # noqa: E402
from pdserve.sim.shift_trace import Phase, phase_bounds, shift_trace  # noqa: E402

REAL_PHASES = (Phase("chat", 20.0, 1.2, (32, 96), (24, 64)), Phase("long", 20.0, 0.35, (384, 768), (4, 12)),
               Phase("chat", 20.0, 1.2, (32, 96), (24, 64)))
WORKERS = 4
BLOCKS, MAX_SEQS = 2048, 64


class Switcher:
    """The controller of planner/switch_control.py over a live deployment (role per worker kept here)."""

    def __init__(self, up: UpProcess, specs, cost, a):
        from pdserve.services.grpc_util import configure
        from pdserve.services.internal_security import InternalSecurity
        configure(InternalSecurity.from_files(up.info["internal_token_file"]))
        self.workers = {w["worker_id"]: [w["role"], f"127.0.0.1:{w['port']}"] for w in up.workers()
                        if w.get("role") in ("prefill", "decode")}
        self.specs, self.cost, self.a = specs, cost, a
        self.shape = PoolShape(MAX_SEQS, BLOCKS, 16, 2048)
        self.rows: list[dict] = []

    def count(self, role: str) -> int:
        return sum(1 for r, _ in self.workers.values() if r == role)

    async def run(self, t0: float, end_s: float) -> None:
        asked, k = 0, 1
        while (now := time.perf_counter() - t0) < end_s:
            await asyncio.sleep(max(0.0, k * self.a.interval - now))
            k += 1
            now = time.perf_counter() - t0
            window = [s for s in self.specs if now - self.a.interval < s.arrival <= now]
            cur = self.count("prefill")
            want = self._want(window, cur) if window else cur
            asked = asked + 1 if want != cur else 0
            if asked < self.a.confirm:
                continue
            asked = 0
            src, dst = ("decode", "prefill") if want > cur else ("prefill", "decode")
            movers = [w for w, (r, _) in self.workers.items() if r == src][:abs(want - cur)]
            d0 = time.perf_counter()
            await asyncio.gather(*(self._switch(w, dst, t0, d0) for w in movers))

    def _want(self, window, cur: int) -> int:
        if self.a.sizing == "share":
            return split_for(window, self.cost, self.shape, WORKERS, self.a.slo_tpot)
        pre, dec = pool_work(window, self.cost, self.shape, self.a.slo_tpot)
        per = self.a.interval * self.a.target_util
        return split_needed(pre / per, dec / per, cur, WORKERS)

    async def _switch(self, wid: str, dst: str, t0: float, d0: float) -> None:
        from pdserve.services.role_cli import switch
        r = await switch(self.workers[wid][1], dst, handoff=self.a.handoff)
        if r.switched:
            self.workers[wid][0] = dst
        self.rows.append({"at_s": round(d0 - t0, 2), "worker": wid, "to": dst, "switched": r.switched,
                          "rpc_s": round(r.seconds, 3), "drain_s": round(r.drain_s, 3), "handed_off": r.handed_off,
                          "decision_to_registered_s": round(time.perf_counter() - d0, 3)})


def _phases(recs, specs, bounds, slo: SLO) -> dict:
    arr = {s.idx: s.arrival for s in specs}
    out = {}
    for name, t0, t1 in bounds:
        sel = [r for r in recs if t0 <= arr[r.idx] < t1]
        s = summarize(sel, slo)["slo"] if sel else {}
        out[f"{name}@{t0:g}"] = {"requests": len(sel), "attainment": s.get("attainment_ratio")}
    return out


async def _drive(up: UpProcess, specs, slo: SLO, switcher: Switcher | None, end_s: float) -> tuple:
    gen = LoadGen(Target(up.base_url, model=up.info["model"]))
    t0 = time.perf_counter()
    tasks = [gen.run_open(specs, drain_timeout_s=60.0)]
    if switcher is not None:
        tasks.append(switcher.run(t0, end_s))
    res = await asyncio.gather(*tasks)
    return res[0], summarize(res[0], slo)


def run_one(kind: str, specs, bounds, slo: SLO, cost, a) -> dict:
    args = {"colocated": ["--mode", "colocated", "--workers", "4"], "switching": ["--mode", "disagg", "--prefill", "2",
                                                                                 "--decode", "2"]}
    args.update({f"static{p}": ["--mode", "disagg", "--prefill", str(p), "--decode", str(WORKERS - p)]
                 for p in range(1, WORKERS)})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "WARNING"}
    up = UpProcess(["--model", "builtin", *args[kind], "--num-gpu-blocks", str(BLOCKS),
                    "--max-num-seqs", str(MAX_SEQS)], env, 240)
    try:
        sw = Switcher(up, specs, cost, a) if kind == "switching" else None
        recs, s = asyncio.run(_drive(up, specs, slo, sw, bounds[-1][2]))
    finally:
        up.stop()
    out = {"mode": kind, "goodput_req_per_s": s["slo"]["goodput_req_per_s"], "attainment": s["slo"]["attainment_ratio"],
           "ok": sum(r.ok for r in recs), "failed": sum(not r.ok for r in recs),
           "errors": dict(Counter(str(r.error)[:60] for r in recs if not r.ok)),
           "phases": _phases(recs, specs, bounds, slo)}
    if sw is not None:
        out["switches"] = sw.rows
    print(json.dumps(out), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--costs", required=True, help="cost model JSON (`pdserve sim profile --model builtin`)")
    ap.add_argument("--only", default="static1,static2,static3,colocated,switching")
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--confirm", type=int, default=2)
    ap.add_argument("--sizing", choices=("need", "share"), default="need", help="planner/switch_control.py")
    ap.add_argument("--target-util", type=float, default=0.8)
    ap.add_argument("--handoff", choices=("drain", "migrate"), default="drain",
                    help="a switching decode worker's streams: finished there, or moved by the gateway's migration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=1.0, help="shorten every phase (a smoke run)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from pdserve.sim.costmodel import load_cost_model
    cost = load_cost_model(a.costs)
    specs = shift_trace(WORKERS, REAL_PHASES, a.seed, vocab=4096, time_scale=a.time_scale)
    bounds, slo = phase_bounds(REAL_PHASES, a.time_scale), SLO(ttft=a.slo_ttft, tpot=a.slo_tpot)
    runs = [run_one(k, specs, bounds, slo, cost, a) for k in a.only.split(",")]
    statics = [r for r in runs if r["mode"].startswith("static")]
    res = {"requests": len(specs), "runs": runs}
    sw = next((r for r in runs if r["mode"] == "switching"), None)
    if statics and sw:
        best = max(statics, key=lambda r: r["goodput_req_per_s"])
        res["best_static"] = best["mode"]
        res["switching_over_best_static"] = sw["goodput_req_per_s"] / max(best["goodput_req_per_s"], 1e-12)
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
