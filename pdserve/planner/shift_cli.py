"""`pdserve sim shift`: role switching against static P:D splits and colocated on the phase-shift trace
(shift_compare.py, docs/planner.md)."""
from __future__ import annotations

import json
import sys


def add_shift_parser(ss) -> None:
    sh = ss.add_parser("shift", help="switching roles vs the best static P:D split vs colocated, on a workload "
                                     "that shifts from chat to long prompts and back")
    sh.add_argument("--workers", default="4,64", help="cluster sizes, comma-separated")
    sh.add_argument("--costs", required=True, help="calibrated cost model JSON (`pdserve sim profile`)")
    sh.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker")
    sh.add_argument("--slo-ttft", type=float, default=1.5, help="seconds (p90 is not used: per request)")
    sh.add_argument("--slo-tpot", type=float, default=0.05, help="seconds")
    sh.add_argument("--interval", type=float, default=2.0, help="controller interval, virtual seconds")
    sh.add_argument("--confirm", type=int, default=2, help="consecutive intervals before a change")
    sh.add_argument("--sizing", choices=("need", "share"), default="need",
                    help="the split asked for: need (the fewest moves that give each pool its work at --target-util) "
                         "| share (every interval the work's share, the first controller)")
    sh.add_argument("--target-util", type=float, default=0.8, help="sizing need: a pool's busy share it is sized for")
    sh.add_argument("--switch-s", type=float, default=0.5, help="a role switch's time after its drain")
    sh.add_argument("--start-s", type=float, default=30.0, help="a new pod's time to serve")
    sh.add_argument("--trace", choices=("shift", "heavy"), default="shift",
                    help="shift: chat 12 / long 2 req/s per worker, 30 s phases; heavy: 30 / 5 req/s per worker, 60 s "
                         "phases, more than any static split serves (sim/shift_trace.py)")
    sh.add_argument("--time-scale", type=float, default=1.0, help="shorten every phase (same rates)")
    sh.add_argument("--handoff", default="drain",
                    help="a switching decode worker's streams, comma-separated for one switching run each: drain "
                         "(finished there) | migrate (moved by the gateway's migration: re-prefilled elsewhere)")
    sh.add_argument("--seed", type=int, default=0)
    sh.add_argument("--json", default=None, help="write the full result here")
    sh.set_defaults(func=cmd_shift)


def cmd_shift(a) -> int:
    from pdserve.planner.shift_compare import ShiftSetup, compare
    from pdserve.planner.switch_control import ControlSpec
    from pdserve.sim.costmodel import load_cost_model
    from pdserve.sim.shift_trace import TRACES, phase_bounds, shift_trace
    from pdserve.sim.workload import SLO
    cm = load_cost_model(a.costs)
    handoffs = tuple(h.strip() for h in a.handoff.split(",") if h.strip())
    bad = [h for h in handoffs if h not in ("drain", "migrate")]
    if bad or not handoffs:
        raise SystemExit(f"pdserve sim shift: --handoff takes drain and/or migrate, not {a.handoff!r}")
    ctl = ControlSpec(a.interval, a.confirm, a.switch_s, a.start_s, a.slo_ttft, a.slo_tpot,
                      sizing=a.sizing, target_util=a.target_util)
    out = []
    for n in (int(x) for x in a.workers.split(",")):
        print(f"{n} workers:", file=sys.stderr)
        phases = TRACES[a.trace]
        st = ShiftSetup(n, shift_trace(n, phases, a.seed, time_scale=a.time_scale),
                        phase_bounds(phases, a.time_scale), cm, a.num_blocks,
                        SLO(ttft=a.slo_ttft, tpot=a.slo_tpot), control=ctl, handoffs=handoffs)
        res = compare(st, log=lambda m: print(m, file=sys.stderr, flush=True))
        out.append(res)
        print(format_result(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trace": a.trace, "time_scale": a.time_scale, "cost_model": cm.to_json(),
                       "control": vars(ctl) if hasattr(ctl, "__dict__") else str(ctl), "results": out},
                      f, indent=2, default=str)
    return 0


def format_result(res: dict) -> str:
    ratios = res.get("over_best_static_by_handoff") or {"": res["switching_over_best_static"]}
    lines = [f"{res['workers']} workers, {res['requests']} requests: switching / best static = "
             + ", ".join(f"{x:.2f}x" + (f" ({h})" if h else "") for h, x in ratios.items())]
    if "ceiling_req_per_s" in res:
        lines.append(f"  ceiling (every request within its SLO): {res['ceiling_req_per_s']:.2f} req/s = "
                     f"{res['ceiling_over_best_static']:.2f}x the best static split")
    runs = list((res.get("switching_by_handoff") or {"": res["switching"]}).values())
    for r in runs + [res["best_static"], res["colocated"]]:
        ph = ", ".join(f"{k} {v['attainment']:.2f}" for k, v in r["phases"].items() if v["attainment"] is not None)
        lines.append(f"  {r['mode']:20} goodput {r['goodput_req_per_s']:7.2f} req/s  attainment "
                     f"{r['attainment']:.3f}  (per phase: {ph})")
    for r in runs:
        sw = r.get("switches")
        if sw and sw["count"]:
            d = sw["decision_to_serving_s"]
            lines.append(f"  {r['mode']}: {sw['count']} switches ({', '.join(sw['outcomes'])}), "
                         f"{sw.get('handed_off', 0)} streams handed off, decision -> serving median "
                         f"{d['median']:.2f} s, max {d['max']:.2f} s")
        elif sw:
            lines.append(f"  {r['mode']}: no switches")
    return "\n".join(lines)
