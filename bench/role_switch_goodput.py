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

`--trace hosts --worker-cpus 0.25 --max-num-seqs 8`: every worker capped at a quarter of a core (`up --worker-cpus`),
so that each is a fixed unit of capacity as on a cluster; the trace sized for such workers (HOSTS_PHASES). Every
deployment first gets an uncounted warm-up (`_warm`), and the controller's profile is scaled to what the warm-up
showed (`ObservedCost`).

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
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.breakeven import cpu_name  # noqa: E402
from pdserve.bench.client import LoadGen, Target  # noqa: E402
from pdserve.bench.metrics import SLO, summarize, tpot  # noqa: E402
from pdserve.planner.switch_control import ControlSpec, PoolShape, SplitDecider, decode_batch  # noqa: E402
from pdserve.services.up_process import UpProcess  # noqa: E402
from pdserve.sim.costmodel import StepShape  # noqa: E402
from pdserve.sim.shift_trace import Phase, phase_bounds, shift_trace  # noqa: E402

REAL_PHASES = (Phase("chat", 20.0, 1.2, (32, 96), (24, 64)), Phase("long", 20.0, 0.35, (384, 768), (4, 12)),
               Phase("chat", 20.0, 1.2, (32, 96), (24, 64)))
# `--trace hosts`, for `--worker-cpus 0.25` (each worker a host of a quarter of a core: a fixed unit of capacity, as a
# GPU is, rather than a share of the box's two cores; services/cpu_share.py) and `--max-num-seqs 8` (a small KV
# pool). Measured there (AMD EPYC family 25 model 17): a decode worker serves ~1.7 chat req/s (8 streams of 128-256
# tokens at ~25 ms a token), a prefill worker ~1 prompt/s of 384-768 tokens. Each phase keeps ~80% of 3 workers of
# one role busy, so 2 of them are short by a fifth or more, and the long phase holds ~70% as many requests as both
# chat phases: no static split serves both kinds (docs/planner.md, "Role switching on emulated hosts").
HOSTS_PHASES = (Phase("chat", 30.0, 1.05, (32, 128), (128, 256)), Phase("long", 80.0, 0.55, (384, 768), (8, 24)),
                Phase("chat", 30.0, 1.05, (32, 128), (128, 256)))
TRACES = {"real": REAL_PHASES, "hosts": HOSTS_PHASES}
WORKERS = 4
BLOCKS = 2048


class Switcher:
    """The controller of planner/switch_control.py (its SplitDecider) over a live deployment (role per worker kept
    here)."""

    def __init__(self, up: UpProcess, specs, cost, a):
        from pdserve.services.grpc_util import configure
        from pdserve.services.internal_security import InternalSecurity
        configure(InternalSecurity.from_files(up.info["internal_token_file"]))
        self.workers = {w["worker_id"]: [w["role"], f"127.0.0.1:{w['port']}"] for w in up.workers()
                        if w.get("role") in ("prefill", "decode")}
        self.specs, self.a = specs, a
        spec = ControlSpec(interval_s=a.interval, confirm=a.confirm, slo_ttft=a.slo_ttft, slo_tpot=a.slo_tpot,
                           handoff=a.handoff, sizing=a.sizing, target_util=a.target_util)
        self.decider = SplitDecider(spec, PoolShape(a.max_num_seqs, BLOCKS, 16, 2048), cost)
        self.rows: list[dict] = []

    def count(self, role: str) -> int:
        return sum(1 for r, _ in self.workers.values() if r == role)

    async def run(self, t0: float, end_s: float) -> None:
        k = 1
        while (now := time.perf_counter() - t0) < end_s:
            await asyncio.sleep(max(0.0, k * self.a.interval - now))
            k += 1
            now = time.perf_counter() - t0
            window = [s for s in self.specs if now - self.a.interval < s.arrival <= now]
            cur = self.count("prefill")
            want = self.decider.decide(now, window, cur, WORKERS)
            if want is None or want == cur:
                continue
            src, dst = ("decode", "prefill") if want > cur else ("prefill", "decode")
            movers = [w for w, (r, _) in self.workers.items() if r == src][:abs(want - cur)]
            d0 = time.perf_counter()
            await asyncio.gather(*(self._switch(w, dst, t0, d0) for w in movers))

    async def flip_all(self) -> None:
        """Every worker to its other role (warm-up: not recorded)."""
        from pdserve.services.role_cli import switch
        for wid, (role, addr) in list(self.workers.items()):
            dst = "decode" if role == "prefill" else "prefill"
            if (await switch(addr, dst, handoff=self.a.handoff)).switched:
                self.workers[wid][0] = dst

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


@dataclass
class ObservedCost:
    """The controller's cost model scaled to the deployment it drives: a profile times the engine's steps alone,
    and a worker serving requests spends more per prompt and per step (its service layer, the streaming, and on a
    capped worker the throttling: x3 a prompt, x10 and more a step at a quarter of a core here). One scale per kind
    of step, the median of observed / modelled over the warm-up's requests: prefill from each response's
    server-side prefill stage; decode from its client TPOT against the model's step at the batch the pool runs when
    full (`decode_batch`). A step of a worker this small is its fixed overhead (a quarter of a core: ~17 ms at one
    stream, ~25 ms at 8), so the warm-up's TPOT at small batches stands for a full batch's; where steps grow with
    the batch more than that, the decode pool is sized small by the difference."""
    cost: object
    prefill: float
    decode: float

    def step_time(self, s: StepShape) -> float:
        return self.cost.step_time(s) * (self.prefill if s.prefill_seqs else self.decode)


def observed_cost(cost, records, shape: PoolShape, slo_tpot: float) -> ObservedCost:
    pre, dec = [], []
    for r in records:
        if not r.ok or not r.prompt_tokens:
            continue
        d = (r.stages or {}).get("durations") or {}
        if d.get("prefill"):
            pre.append(d["prefill"] / cost.step_time(StepShape.prefill(r.prompt_tokens)))
        if r.n_out >= 8:
            ctx = r.prompt_tokens + r.n_out // 2
            b = decode_batch(cost, shape, ctx, slo_tpot)
            dec.append(tpot(r) / cost.step_time(StepShape.decode(b, b * ctx)))
    return ObservedCost(cost, statistics.median(pre) if pre else 1.0, statistics.median(dec) if dec else 1.0)


async def _warm(gen: LoadGen, phases, seconds: float, switcher: Switcher | None) -> list:
    """Before the trace, `seconds` of the trace's own kinds of request at a quarter of its rate, not counted: a
    worker's first requests pay one-off costs its start-up warm-up does not (the first KV pull between a pair, the
    gateway's and router's first calls), ~20 s of them on a worker capped at a quarter of a core. The switching
    deployment is warmed in both splits (every worker switched to its other role and back), as a deployment that
    switches would be before taking traffic: a static worker never serves the other role."""
    seen: list = []
    if seconds <= 0:
        return seen
    warm = tuple(Phase(f"warm-{p.name}", seconds / len(phases), p.rate_per_worker / 4, p.prompt, p.output)
                 for p in phases)
    rounds = (None,) if switcher is None else ("flip", "back")
    for r in rounds:
        seen += await gen.run_open(shift_trace(WORKERS, warm, seed=99, vocab=4096), drain_timeout_s=60.0)
        if r is not None:
            await switcher.flip_all()
    return seen


async def _drive(up: UpProcess, specs, slo: SLO, switcher: Switcher | None, end_s: float, a) -> tuple:
    target = Target(up.base_url, model=up.info["model"])
    warm = await _warm(LoadGen(target), TRACES[a.trace], a.warmup_s, switcher)  # a generator keeps its records
    gen = LoadGen(target)
    if switcher is not None and a.observed_cost and warm:
        d = switcher.decider
        d.cost = observed_cost(d.cost, warm, d.shape, a.slo_tpot)
        print(f"controller cost scaled to the warm-up: prefill x{d.cost.prefill:.2f}, decode x{d.cost.decode:.2f}",
              flush=True)
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
    cap = ["--worker-cpus", str(a.worker_cpus)] if a.worker_cpus else []
    up = UpProcess(["--model", "builtin", *args[kind], "--num-gpu-blocks", str(BLOCKS),
                    "--max-num-seqs", str(a.max_num_seqs), *cap], env, 240)
    try:
        sw = Switcher(up, specs, cost, a) if kind == "switching" else None
        recs, s = asyncio.run(_drive(up, specs, slo, sw, bounds[-1][2], a))
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
    ap.add_argument("--trace", choices=sorted(TRACES), default="real")
    ap.add_argument("--worker-cpus", type=float, default=None,
                    help="`pdserve up --worker-cpus`: each worker capped at this many CPUs (root); profile the "
                         "--costs under the same cap (python -m pdserve.services.cpu_share --cores X --name p -- "
                         "pdserve sim profile)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--no-observed-cost", dest="observed_cost", action="store_false",
                    help="size the splits on the --costs profile as it is, not scaled to the warm-up (ObservedCost)")
    ap.add_argument("--warmup-s", type=float, default=20.0, help="uncounted warm-up traffic per deployment "
                    "(_warm), twice for the switching one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=1.0, help="shorten every phase (a smoke run)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from pdserve.sim.costmodel import load_cost_model
    cost = load_cost_model(a.costs)
    phases = TRACES[a.trace]
    specs = shift_trace(WORKERS, phases, a.seed, vocab=4096, time_scale=a.time_scale)
    bounds, slo = phase_bounds(phases, a.time_scale), SLO(ttft=a.slo_ttft, tpot=a.slo_tpot)
    runs = [run_one(k, specs, bounds, slo, cost, a) for k in a.only.split(",")]
    statics = [r for r in runs if r["mode"].startswith("static")]
    res = {"cpu": cpu_name(), "load_avg_after": os.getloadavg(), "trace": a.trace, "worker_cpus": a.worker_cpus,
           "max_num_seqs": a.max_num_seqs, "requests": len(specs), "runs": runs}
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
