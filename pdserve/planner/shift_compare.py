"""`pdserve sim shift`: the phase-shift trace (shift_trace.py) on N workers, three ways - a P:D split that follows
the load by role switches (switch_control.py), every static P:D split (the best one chosen in hindsight, by SLO
goodput over the whole trace), and N colocated workers - with goodput and SLO attainment overall and per phase.
The switching run is made once per handoff asked for (`drain`: a switching decode worker finishes its streams;
`migrate`: it hands them to the gateway's migration, sim/role_switch.py); the first is `switching` in the result.

Static splits at large N: all of them cost one simulation each, so the search starts at the split the whole
trace's work asks for (switch_control.split_for) and climbs in goodput with steps N/8, N/16, ... down to
`min_step` x N (default N/8: 8 of 64 workers, as fine as a 64-worker run allows on a 2-core box: each simulation
takes minutes there); at N <= `exhaustive` every split is simulated.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from pdserve.engine.config import EngineConfig
from pdserve.planner.switch_control import ControlSpec, PoolShape, SplitController, split_for
from pdserve.sim.cluster import Cluster, ClusterSpec
from pdserve.sim.workload import SLO, summarize


@dataclass
class ShiftSetup:
    workers: int
    trace: list                    # RequestSpecs (shift_trace)
    bounds: list                   # [(phase, start, end)]
    cost: object
    num_blocks: int
    slo: SLO
    engine: EngineConfig = None
    control: ControlSpec = ControlSpec()
    handoffs: tuple = ("drain",)   # one switching run per handoff
    exhaustive: int = 8
    min_step: float = 1 / 8

    def shape(self) -> PoolShape:
        e = self.engine or EngineConfig()
        return PoolShape(e.max_num_seqs, self.num_blocks, e.block_size, e.max_num_batched_tokens)


def _phase_stats(cluster: Cluster, bounds, slo: SLO) -> dict:
    recs = cluster.records()
    out = {}
    for name, t0, t1 in bounds:
        sel = [r for r in recs if t0 <= r.scheduled < t1]
        s = summarize(sel, slo)["slo"] if sel else {}
        out[f"{name}@{t0:g}"] = {"requests": len(sel), "attainment": s.get("attainment_ratio"),
                                 "goodput_req_per_s": len(sel) and s.get("n_slo", 0) / (t1 - t0)}
    return out


def run_one(st: ShiftSetup, prefill: int = 0, colocated: bool = False, switching: bool = False,
            handoff: str | None = None) -> dict:
    """One run of the trace: a static split (`prefill` of `workers`), colocated, or switching (starting from an
    even split: a deployment sized without knowing the trace; `handoff`: the control spec's unless given)."""
    n = st.workers
    if colocated:
        spec = ClusterSpec(colocated=n)
    else:
        p = prefill if not switching else max(1, n // 2)
        spec = ClusterSpec(prefill=p, decode=n - p)
    spec = replace(spec, num_blocks=st.num_blocks, engine=st.engine or EngineConfig())
    c = Cluster(spec, st.cost)
    ctl = None
    if switching:
        control = replace(st.control, handoff=handoff) if handoff else st.control
        ctl = SplitController(c, control, st.shape(), st.trace, end_s=st.bounds[-1][2])
    t = time.monotonic()
    try:
        c.run(st.trace)
        s = c.summary(st.slo)
    finally:
        c.close()
    out = {"mode": f"switching ({ctl.spec.handoff})" if switching else "colocated" if colocated
           else f"static {spec.label()}",
           "goodput_req_per_s": s["slo"]["goodput_req_per_s"], "attainment": s["slo"]["attainment_ratio"],
           "n_slo": s["slo"]["n_slo"], "n_total": s["slo"]["n_total"], "phases": _phase_stats(c, st.bounds, st.slo),
           "wall_s": time.monotonic() - t}
    if ctl is not None:
        recs = ctl.switcher.records
        took = sorted(r.decision_to_serving_s for r in recs if r.decision_to_serving_s is not None)
        out["switches"] = {"count": len(recs), "outcomes": sorted({r.outcome for r in recs}),
                           "handed_off": ctl.switcher.handed_off,
                           "decision_to_serving_s": {"median": took[len(took) // 2] if took else None,
                                                     "max": took[-1] if took else None},
                           "splits": [(round(t, 1), w, cur) for t, w, cur in ctl.history]}
    return out


def best_static(st: ShiftSetup, log=lambda *_: None) -> tuple[dict, list[dict]]:
    """The static split with the highest goodput over the trace (module docstring), and every run made."""
    n = st.workers
    runs: dict[int, dict] = {}

    def at(p: int) -> float:
        if p not in runs:
            runs[p] = run_one(st, prefill=p)
            log(f"  {runs[p]['mode']}: goodput {runs[p]['goodput_req_per_s']:.2f} req/s, "
                f"attainment {runs[p]['attainment']:.3f} ({runs[p]['wall_s']:.0f} s)")
        return runs[p]["goodput_req_per_s"]

    if n <= st.exhaustive:
        for p in range(1, n):
            at(p)
    else:
        p = split_for(st.trace, st.cost, st.shape(), n, st.control.slo_tpot)
        step = max(1, n // 8)
        while True:
            nb = [q for q in (p - step, p + step) if 1 <= q < n]
            best = max(nb + [p], key=at)
            if best != p:
                p = best
            elif step <= max(1, int(n * st.min_step)):
                break
            else:
                step //= 2
    best = max(runs.values(), key=lambda r: r["goodput_req_per_s"])
    return best, [runs[k] for k in sorted(runs)]


def compare(st: ShiftSetup, log=lambda *_: None) -> dict:
    by_handoff = {}
    for h in st.handoffs:
        sw = by_handoff[h] = run_one(st, switching=True, handoff=h)
        log(f"  {sw['mode']}: goodput {sw['goodput_req_per_s']:.2f} req/s, attainment {sw['attainment']:.3f} "
            f"({sw['wall_s']:.0f} s)")
    co = run_one(st, colocated=True)
    log(f"  colocated: goodput {co['goodput_req_per_s']:.2f} req/s, attainment {co['attainment']:.3f}")
    best, statics = best_static(st, log)
    bg = max(best["goodput_req_per_s"], 1e-12)
    first = by_handoff[st.handoffs[0]]
    ceiling = len(st.trace) / (st.bounds[-1][2] - st.bounds[0][1])  # every request within its SLO
    return {"workers": st.workers, "requests": len(st.trace), "switching": first, "best_static": best,
            "ceiling_req_per_s": ceiling, "ceiling_over_best_static": ceiling / bg,
            "colocated": co, "statics": statics,
            "switching_over_best_static": first["goodput_req_per_s"] / bg,
            "switching_by_handoff": by_handoff,
            "over_best_static_by_handoff": {h: r["goodput_req_per_s"] / bg for h, r in by_handoff.items()}}
