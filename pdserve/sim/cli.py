"""`pdserve sim profile | roofline | run | plan | validate | shift` (docs/sim.md; shift: docs/planner.md)."""
from __future__ import annotations

import json
import sys
import time


def _slo(a):
    from pdserve.sim.workload import SLO
    return SLO(ttft=a.slo_ttft, tpot=a.slo_tpot)


def _engine_cfg(a):
    from pdserve.engine.config import EngineConfig
    return EngineConfig(block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                        max_num_batched_tokens=a.max_num_batched_tokens,
                        enable_prefix_caching=not a.no_prefix_caching, batching=a.batching)


def _cost(a):
    """(cost model, KV blocks per replica, tp, description)."""
    if a.costs:
        from pdserve.sim.costmodel import load_cost_model
        cm = load_cost_model(a.costs)
        return cm, a.num_blocks or 4096, 1, {"kind": "calibrated linear (prediction for the profiled machine)",
                                              "file": a.costs, **{k: getattr(cm, k) for k in "abcd"}}
    from pdserve.sim.roofline import RooflineCostModel, get_gpu, get_model, min_tp
    m, g = get_model(a.model).with_kv_cache_dtype(a.kv_cache_dtype), get_gpu(a.gpu)
    tp = a.tp or min_tp(m, g)
    cm = RooflineCostModel(m, g, tp, a.link)
    return cm, a.num_blocks or cm.kv_blocks(a.block_size), tp, cm.describe()


def _pools(a, desc: dict) -> dict:
    """role -> PoolCost for --prefill-tp / --decode-tp (roofline only): the pool's own degree, hence its own
    step bound and KV blocks; noted in `desc`."""
    from pdserve.sim.cluster import PoolCost
    pools = {}
    for role, tp in (("prefill", a.prefill_tp), ("decode", a.decode_tp)):
        if not tp:
            continue
        if a.costs:
            raise SystemExit(f"--{role}-tp needs the roofline: a calibrated cost model was profiled at one degree")
        from pdserve.sim.roofline import RooflineCostModel, get_gpu, get_model
        cm = RooflineCostModel(get_model(a.model).with_kv_cache_dtype(a.kv_cache_dtype), get_gpu(a.gpu), tp, a.link)
        pools[role] = PoolCost(cm, a.num_blocks or cm.kv_blocks(a.block_size), tp)
        desc.setdefault("pools", {})[role] = {"tp": tp, "kv_blocks": pools[role].num_blocks}
    return pools


def _workload_fn(a):
    from pdserve.sim.workload import LengthDist, load_trace, synthetic

    if a.trace:
        def wl(rate, n, seed):
            specs = load_trace(a.trace, n=n, rate=rate, seed=seed)
            return specs
    else:
        pl, ol = LengthDist.parse(a.prompt_len), LengthDist.parse(a.output_len)

        def wl(rate, n, seed):
            return synthetic(n, rate, pl, ol, seed=seed)
    return wl


def _common(p, model_default="llama-3-8b"):
    p.add_argument("--gpu", default="H100", help="roofline GPU: H100 | H200 | A100")
    p.add_argument("--model", default=model_default, help="roofline model: llama-3-8b | llama-3-70b | qwen2.5-7b | "
                                                          "deepseek-v3 | gpt-oss-120b")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel GPUs per replica (default: least that fits; "
                                                        "an MoE model's experts split over the same GPUs, EP = TP)")
    p.add_argument("--prefill-tp", type=int, default=None, help="the prefill pool's own degree (default --tp)")
    p.add_argument("--decode-tp", type=int, default=None, help="the decode pool's own degree (default --tp)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                   help="roofline KV storage: auto (the weights' bf16) or fp8_e4m3 (1 byte per value)")
    p.add_argument("--link", choices=["ib", "nvlink"], default="ib", help="what carries KV between replicas")
    p.add_argument("--costs", default=None, help="calibrated cost model JSON (from `pdserve sim profile`) "
                                                 "instead of the roofline")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica (default: from GPU memory)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--batching", choices=["continuous", "static"], default="continuous",
                   help="replicas' batching mode (static: the §5.2 baseline, docs/engine.md)")
    p.add_argument("--slo-ttft", type=float, default=0.5, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="seconds")
    p.add_argument("--trace", default=None, help="bench trace file (lengths; arrivals re-drawn at --rate)")
    p.add_argument("--prompt-len", default="uniform:128:2048", help="bench length distribution")
    p.add_argument("--output-len", default="uniform:32:512", help="bench length distribution")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the full result here")


def add_sim_parser(sub):
    sim = sub.add_parser("sim", help="cluster-scale simulation over the real scheduler (plan, validate)")
    ss = sim.add_subparsers(dest="sim_command", required=True)

    pr = ss.add_parser("profile", help="measure step times of the real engine here; fit the linear cost model")
    pr.add_argument("--model", default="builtin")
    pr.add_argument("--out", default="sim-costs.json")
    pr.add_argument("--threads", type=int, default=1, help="torch threads (match the deployment you predict)")
    pr.add_argument("--repeats", type=int, default=1)
    pr.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                    help="the KV pool the profiled steps run over (and its bytes per token for the transfer term)")
    pr.set_defaults(func=cmd_profile)

    rf = ss.add_parser("roofline", help="print the roofline bound numbers for a GPU and model")
    rf.add_argument("--gpu", default="H100")
    rf.add_argument("--model", default="llama-3-8b")
    rf.add_argument("--tp", type=int, default=None)
    rf.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto")
    rf.add_argument("--context", type=int, default=1024)
    rf.set_defaults(func=cmd_roofline)

    rn = ss.add_parser("run", help="simulate one cluster at one rate and print the bench metrics")
    _common(rn)
    rn.add_argument("--prefill", type=int, default=0)
    rn.add_argument("--decode", type=int, default=0)
    rn.add_argument("--colocated", type=int, default=0)
    rn.add_argument("--rate", type=float, required=True)
    rn.add_argument("--requests", type=int, default=1000)
    rn.add_argument("--out", default=None, help="report dir: results.json, cdf.png, report.html (as pdserve bench)")
    rn.add_argument("--router-policy", default="cache-aware",
                    choices=["cache-aware", "round-robin", "least-loaded", "oracle"],
                    help="the router's Policy, or a baseline (round-robin etc. place on colocated replicas only)")
    rn.add_argument("--router-index", default="direct", choices=["direct", "redis"],
                    help="prefix index fed in-process, or through Redis as a deployment's router does")
    rn.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="with --router-index redis")
    rn.set_defaults(func=cmd_run)

    pl = ss.add_parser("plan", help="cheapest prefill/decode/colocated replica counts meeting an SLO (spec Q19)")
    _common(pl)
    pl.add_argument("--rate", type=float, required=True, help="target mean arrival rate, req/s")
    pl.add_argument("--attainment", type=float, default=0.9, help="target SLO attainment (ratio)")
    pl.add_argument("--peak-factor", type=float, default=1.2, help="headroom: check the cluster at rate x this")
    pl.add_argument("--redundancy", type=int, default=1, help="N+k spare replicas per pool")
    pl.add_argument("--requests", type=int, default=600, help="requests per whole-cluster check")
    pl.add_argument("--sweep-requests", type=int, default=300, help="requests per per-replica sweep point")
    pl.add_argument("--min-span", type=float, default=10.0,
                    help="each simulation's arrivals span at least this many TTFT SLOs (more requests at high rates; "
                         "a shorter run overstates capacity)")
    pl.add_argument("--modes", default="colocated,disagg")
    pl.set_defaults(func=cmd_plan)

    va = ss.add_parser("validate", help="break-even grid here: simulated vs real per cell (in-process engine, or "
                                        "a `pdserve up` deployment driven by `pdserve bench` with --against up)")
    va.add_argument("--against", choices=["engine", "up"], default="engine",
                    help="engine: the in-process Engine (colocated only); up: `pdserve up` deployments, colocated "
                         "and disaggregated, 1 thread per worker")
    va.add_argument("--modes", default="colocated,disagg", help="with --against up")
    va.add_argument("--max-num-seqs", type=int, default=64, help="with --against up")
    va.add_argument("--model", default="builtin")
    va.add_argument("--costs", default=None, help="cost JSON (default: profile now)")
    va.add_argument("--prompt-lens", default="32,512")
    va.add_argument("--rates", default="2,6,12")
    va.add_argument("--output-len", type=int, default=16)
    va.add_argument("--cell-duration", type=float, default=5.0)
    va.add_argument("--slo-ttft", type=float, default=0.5)
    va.add_argument("--slo-tpot", type=float, default=0.05)
    va.add_argument("--threads", type=int, default=1)
    va.add_argument("--num-gpu-blocks", type=int, default=2048)
    va.add_argument("--json", default=None)
    va.set_defaults(func=cmd_validate)
    return ss  # `sim shift` (planner/shift_cli.py) is added by cli.py: the planner builds on the simulator


def cmd_profile(a) -> int:
    from pdserve.sim.costmodel import profile
    t = time.time()
    cm = profile(a.model, threads=a.threads, repeats=a.repeats, log=lambda m: print(m, file=sys.stderr),
                 kv_cache_dtype=a.kv_cache_dtype)
    cm.save(a.out)
    print(f"step_time = {cm.a:.4g} + {cm.e:.4g}*[prefill] + {cm.b:.4g}*prefill_tokens + {cm.c:.4g}*decode_seqs + "
          f"{cm.d:.4g}*sum_context + {cm.f:.4g}*prefill_pairs s, + {cm.wake_s * 1e3:.2g} ms after idle "
          f"(tau {cm.wake_tau_s * 1e3:.0f} ms)"
          f"  (median rel err {cm.meta['median_rel_err']:.1%}, p90 {cm.meta['p90_rel_err']:.1%}, "
          f"{cm.meta['n_samples']} steps, {time.time() - t:.0f} s) -> {a.out}")
    return 0


def cmd_roofline(a) -> int:
    from pdserve.sim.costmodel import StepShape
    from pdserve.sim.roofline import RooflineCostModel, get_gpu, get_model, min_tp
    m, g = get_model(a.model).with_kv_cache_dtype(a.kv_cache_dtype), get_gpu(a.gpu)
    cm = RooflineCostModel(m, g, a.tp or min_tp(m, g))
    d = cm.describe()
    for b in (1, 8, 64, 256):
        s = StepShape.decode(b, b * a.context)
        d[f"decode_step_bound_s_batch{b}_ctx{a.context}"] = cm.step_time(s)
    s = StepShape.prefill(a.context)
    d[f"prefill_bound_s_{a.context}_tokens"] = cm.step_time(s)
    d["kv_transfer_bound_s_per_1k_tokens_ib"] = cm.transfer_time(1000)
    d["kv_blocks_16"] = cm.kv_blocks(16)
    print(json.dumps(d, indent=2))
    return 0


def cmd_run(a) -> int:
    from pdserve.sim.cluster import Cluster, ClusterSpec
    from pdserve.sim.placer import RouterSpec
    cm, blocks, tp, desc = _cost(a)
    router = RouterSpec(policy=a.router_policy, index=a.router_index, redis_url=a.redis_url)
    if router.policy != "cache-aware" and (a.prefill or a.decode):
        raise SystemExit(f"--router-policy {router.policy} places on colocated replicas only")
    spec = ClusterSpec(prefill=a.prefill, decode=a.decode, colocated=a.colocated, num_blocks=blocks,
                       engine=_engine_cfg(a), seed=a.seed, router=router, pools=_pools(a, desc))
    specs = _workload_fn(a)(a.rate, a.requests, a.seed)
    t = time.time()
    c = Cluster(spec, cm)
    try:
        c.run(specs)
    finally:
        c.close()
    s = c.summary(_slo(a))
    s["cost_model"] = desc
    s["sim_wall_s"] = time.time() - t
    s["sim_events"] = c.events_processed
    _print_summary(s, spec.label(), a.rate)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=2, default=str)
    if a.out:
        from pdserve.sim.report import sim_point, write_report
        meta = {"command": "pdserve sim run", "cluster": spec.label(), "rate_req_per_s": a.rate,
                "requests": a.requests, "cost_model": desc, "admission": s.get("admission"),
                "slo": {"ttft_s": a.slo_ttft, "tpot_s": a.slo_tpot}, "seed": a.seed}
        files = write_report(a.out, sim_point(c, s, f"sim {spec.label()} {a.rate:g} req/s", a.rate), meta)
        print("report: " + ", ".join(str(p) for p in files.values()))
    return 0


def _print_summary(s: dict, label: str, rate: float) -> None:
    lat, th, slo = s["latency"], s["throughput"], s["slo"]
    print(f"{label} at {rate:g} req/s: {s['n_ok']}/{s['n_requests']} ok, simulated {th['window_s']:.1f} s in "
          f"{s.get('sim_wall_s', 0):.1f} s wall")
    for m in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        d = lat[m]
        if d.get("n"):
            print(f"  {m[:-2].upper():5} mean {d['mean']:.4f}  p50 {d['p50']:.4f}  p90 {d['p90']:.4f}  "
                  f"p99 {d['p99']:.4f} s")
    print(f"  throughput: {th['request_throughput_req_per_s']:.3g} req/s, "
          f"{th['output_token_throughput_tok_per_s']:.4g} output tok/s, "
          f"{th['total_token_throughput_tok_per_s']:.4g} total tok/s")
    print(f"  SLO attainment {slo['attainment_ratio']:.3f} (ratio); goodput {slo['goodput_req_per_s']:.3g} req/s "
          f"(rate)")
    adm = s.get("admission")
    if adm:
        print(f"  admission: {adm['admitted']} admitted ({adm['admitted_after_queue']} after queueing), "
              f"{adm['queued']} queued, {adm['timed_out']} timed out, {adm['rejected_capacity']} rejected (503), "
              f"{adm['rejected_context']} rejected (400), {adm['degraded']} degraded")


def cmd_plan(a) -> int:
    from pdserve.sim.plan import PlanInput, format_plan, plan
    cm, blocks, tp, desc = _cost(a)
    pi = PlanInput(rate=a.rate, slo=_slo(a), workload=_workload_fn(a), cost=cm, num_blocks=blocks,
                   engine=_engine_cfg(a), tp=tp, pools=_pools(a, desc), attainment=a.attainment, peak_factor=a.peak_factor,
                   redundancy=a.redundancy, requests=a.requests, sweep_requests=a.sweep_requests,
                   min_span_ttfts=a.min_span,
                   modes=tuple(m.strip() for m in a.modes.split(",")), seed=a.seed,
                   log=lambda m: print(m, file=sys.stderr))
    t = time.time()
    res = plan(pi)
    res["cost_model"] = desc
    res["plan_wall_s"] = time.time() - t
    print(format_plan(res, desc))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


def _validate_up(a, cm) -> int:
    from pdserve.sim import validate_up as VU
    from pdserve.sim.workload import SLO
    print(VU.format_header())
    rows = VU.grid(a.model, cm, [int(x) for x in a.prompt_lens.split(",")], [float(x) for x in a.rates.split(",")],
                   a.output_len, a.cell_duration, SLO(ttft=a.slo_ttft, tpot=a.slo_tpot),
                   modes=tuple(m.strip() for m in a.modes.split(",")), num_gpu_blocks=a.num_gpu_blocks,
                   max_num_seqs=a.max_num_seqs, log=lambda m: print(m, flush=True))
    for m in ("ttft_s", "tpot_s"):
        errs = [abs(r[f"{m}_mean_err"]) for r in rows if r[f"{m}_mean_err"] is not None]
        if errs:
            print(f"{m[:-2].upper()}: mean |error| {sum(errs) / len(errs):.0%}, max {max(errs):.0%}")
    print(VU.markdown_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"against": "up", "cost_model": cm.to_json(), "cells": rows}, f, indent=2, default=str)
    return 0


def cmd_validate(a) -> int:
    import torch

    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.sim import validate as V
    from pdserve.sim.costmodel import load_cost_model, profile
    from pdserve.sim.workload import SLO

    torch.set_num_threads(a.threads)
    cm = load_cost_model(a.costs) if a.costs else profile(a.model, threads=a.threads)
    if a.against == "up":
        return _validate_up(a, cm)
    eng = Engine.from_pretrained(a.model, EngineConfig(num_gpu_blocks=a.num_gpu_blocks))
    print(V.format_header())
    rows = V.grid(eng, cm, [int(x) for x in a.prompt_lens.split(",")], [float(x) for x in a.rates.split(",")],
                  a.output_len, a.cell_duration, SLO(ttft=a.slo_ttft, tpot=a.slo_tpot), log=print)
    errs = [abs(r[k]) for r in rows for k in ("ttft_s_mean_err", "tpot_s_mean_err") if r[k] is not None]
    if errs:
        print(f"mean |error| over cells: {sum(errs) / len(errs):.0%}; max {max(errs):.0%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cost_model": cm.to_json(), "cells": rows}, f, indent=2)
    return 0
