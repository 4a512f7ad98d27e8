"""`pdserve bench run | sweep | breakeven` (registered by pdserve/cli.py via add_bench_parser)."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from pdserve.bench import metrics as MX
from pdserve.bench.progress import Progress


def _add_target(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI-compatible server (with or without /v1)")
    g.add_argument("--model", default=None, help="model name (default: first id of GET /v1/models)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--api-key", action="append", default=[], help="repeat per tenant: tenant t uses key t %% len")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos/min_tokens (servers without the extension); lengths become upper bounds")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    g.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, s")
    g.add_argument("--metrics-url", action="append", default=[],
                   help="Prometheus endpoints for the per-stage breakdown (gateway /metrics, worker metrics ports)")


def _add_workload(p: argparse.ArgumentParser, with_lengths: bool = True) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=None, help="requests per load point (default: rate x duration)")
    g.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per load point")
    g.add_argument("--min-requests", type=int, default=20)
    g.add_argument("--max-requests", type=int, default=2000)
    if with_lengths:
        g.add_argument("--prompt-len", default="lognormal:128:0.5:1024",
                       help="fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:MAX] (tokens)")
        g.add_argument("--output-len", default="uniform:16:64")
    g.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="ids: token-id prompts of exact length (pdserve, vLLM); text: words")
    g.add_argument("--token-range", default="3:250", help="LO:HI token ids for id prompts (stay inside the vocab)")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a per-tenant shared system prompt")
    g.add_argument("--shared-prefix-frac", type=float, default=0.0, help="fraction of requests that use it")
    g.add_argument("--tenants", type=int, default=1)
    g.add_argument("--trace", default=None, help="JSONL/JSON trace (timestamp, prompt|prompt_len, output_len; ShareGPT)")
    g.add_argument("--trace-time-scale", type=float, default=1.0)
    g.add_argument("--arrival", choices=["poisson", "gamma", "constant"], default="poisson")
    g.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation (>1 bursty)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--warmup", type=int, default=2, help="sequential warm-up requests before the schedule")
    g.add_argument("--warmup-seconds", type=float, default=0.0, help="scheduled arrivals before this are warm-up")
    g.add_argument("--drain-timeout", type=float, default=60.0, help="s after the last arrival before giving up")
    s = p.add_argument_group("SLO")
    s.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    s.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    s.add_argument("--slo-e2e", type=float, default=None, help="seconds")
    p.add_argument("--out", default="bench-results", help="output directory")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-records", action="store_true", help="leave per-request rows out of the JSON")


def add_bench_parser(sub) -> None:
    bp = sub.add_parser("bench", help="load generator, sweeps, disaggregation break-even study")
    bsub = bp.add_subparsers(dest="bench_command", required=True)

    r = bsub.add_parser("run", help="one load point (open loop at --rate, or closed loop at --concurrency)")
    _add_target(r)
    _add_workload(r)
    m = r.add_mutually_exclusive_group()
    m.add_argument("--rate", type=float, default=None, help="offered req/s, open loop (default 2)")
    m.add_argument("--concurrency", type=int, default=None, help="closed loop users (coordinated-omission prone)")
    r.set_defaults(func=cmd_run)

    s = bsub.add_parser("sweep", help="offered rates from light load past saturation; finds the knee")
    _add_target(s)
    _add_workload(s)
    s.add_argument("--rates", default=None, help="comma-separated req/s (default: geometric, stops past the knee)")
    s.add_argument("--rate-start", type=float, default=0.5)
    s.add_argument("--rate-factor", type=float, default=2.0)
    s.add_argument("--max-points", type=int, default=8)
    s.add_argument("--attainment-target", type=float, default=0.9)
    s.add_argument("--saturation-ratio", type=float, default=0.9)
    s.set_defaults(func=cmd_sweep)

    from pdserve.bench.breakeven import add_args
    b = bsub.add_parser("breakeven", help="colocated vs disaggregated on the same cores: goodput heat map")
    add_args(b)
    b.set_defaults(func=cmd_breakeven)


# ---- building blocks shared by the commands ----------------------------------------------------------------
def make_target(a):
    from pdserve.bench.client import Target
    return Target(a.base_url, a.model, a.endpoint, list(a.api_key), not a.no_ignore_eos, a.temperature,
                  json.loads(a.extra_body), a.timeout)


def make_slo(a) -> MX.SLO:
    return MX.SLO(a.slo_ttft, a.slo_tpot, a.slo_e2e)


def make_specs(a, rate: float | None, n_default: int | None = None, seed_offset: int = 0):
    """Warm-up + measured specs. Each sweep point gets its own seed (seed_offset): identical prompts in a later
    point would hit the server's prefix cache and skip prefill."""
    from pdserve.bench.workload import LengthDist, PromptMaker, load_trace, synthetic
    lo, hi = (int(x) for x in a.token_range.split(":"))
    maker = PromptMaker(a.prompt_format, (lo, hi), a.shared_prefix_len, a.shared_prefix_frac, a.tenants)
    seed = a.seed + seed_offset
    n = a.num_requests or n_default or max(a.min_requests, min(a.max_requests, round((rate or 2) * a.duration)))
    chat = a.endpoint == "chat"
    if a.trace:
        specs = load_trace(a.trace, n=n + a.warmup, rate=rate, seed=seed, process=a.arrival, cv=a.cv,
                           time_scale=a.trace_time_scale, tenants=a.tenants, chat=chat, maker=maker)
    else:
        specs = synthetic(n + a.warmup, rate or 0.0, LengthDist.parse(a.prompt_len), LengthDist.parse(a.output_len),
                          seed=seed, process=a.arrival, cv=a.cv, maker=maker, chat=chat)
    warm, specs = specs[:a.warmup], specs[a.warmup:]
    if specs:
        t0 = specs[0].arrival
        for s in specs:
            s.arrival -= t0
    return warm, specs


def workload_meta(a, rate) -> dict:
    return {"prompt_len": None if a.trace else a.prompt_len, "output_len": None if a.trace else a.output_len,
            "trace": a.trace, "arrival": a.arrival, "cv": a.cv, "seed": a.seed, "offered_rate_req_per_s": rate,
            "prompt_format": a.prompt_format, "shared_prefix_len": a.shared_prefix_len,
            "shared_prefix_frac": a.shared_prefix_frac, "tenants": a.tenants, "endpoint": a.endpoint,
            "ignore_eos": not a.no_ignore_eos}


def print_points(points: list[dict], title: str = "results") -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title)
    for c in ("load point", "mode", "n ok/all", "TTFT p50", "TTFT p99 [95% CI]", "ITL p50", "TPOT p99",
              "req/s", "out tok/s", "total tok/s", "attain.", "goodput req/s", "client"):
        t.add_column(c)
    for p in points:
        s = p["steady"]
        L = s["latency"]
        lo, hi = L["ttft_s"].get("p99_ci", [None, None])
        ms = lambda x: "–" if x is None else f"{x * 1e3:.1f}ms"  # noqa: E731
        c = p.get("client") or {}
        t.add_row(p.get("label") or f"{p.get('offered_rate_req_per_s') or ''}",
                  p["mode"] + (" INTERRUPTED" if p.get("interrupted") else ""),
                  f"{s['n_ok']}/{s['n_requests']}", ms(L["ttft_s"].get("p50")),
                  f"{ms(L['ttft_s'].get('p99'))} [{ms(lo)}, {'n<368' if hi is None else ms(hi)}]",
                  ms(L["itl_s"].get("p50")), ms(L["tpot_s"].get("p99")),
                  f"{s['throughput']['request_throughput_req_per_s']:.2f}",
                  f"{s['throughput']['output_token_throughput_tok_per_s']:.1f}",
                  f"{s['throughput']['total_token_throughput_tok_per_s']:.1f}",
                  f"{s['slo']['attainment_ratio']:.3f}", f"{s['slo']['goodput_req_per_s']:.2f}",
                  "BOTTLENECK" if c.get("bottleneck") else "ok")
    Console(stderr=True, width=max(160, Console(stderr=True).width)).print(t)


def _finish(result: dict, a, title: str) -> int:
    from pdserve.bench.report import run_report
    files = run_report(result, Path(a.out), title)
    print_points(result["points"], title)
    for p in result["points"]:
        c = p.get("client") or {}
        if c.get("bottleneck"):
            print(f"WARNING: the load generator may be the bottleneck at {p.get('label')}: {'; '.join(c['reasons'])}",
                  file=sys.stderr)
    if result.get("knee"):
        k = result["knee"]
        print(f"knee: {k.get('knee_rate_req_per_s')} req/s (goodput {k.get('knee_goodput_req_per_s')}); first broken "
              f"{k.get('first_broken_rate_req_per_s')} req/s {k.get('note', '')}", file=sys.stderr)
    for k, v in files.items():
        print(f"{k}: {v}")
    return 130 if result.get("interrupted") else 0


# ---- commands ----------------------------------------------------------------------------------------------
def _meta(a, kind: str) -> dict:
    return {"kind": kind, "argv": sys.argv[1:], "started_unix": time.time(), "base_url": a.base_url,
            "slo": make_slo(a).as_dict(), "python": sys.version.split()[0]}


def cmd_run(a) -> int:
    from pdserve.bench.runner import PointConfig, run_point, summarize_point
    rate = a.rate if a.concurrency is None else None
    if a.concurrency is None and rate is None:
        rate = 2.0
    warm, specs = make_specs(a, rate)
    target, slo = make_target(a), make_slo(a)
    cfg = PointConfig(label=(f"{rate:g} req/s" if rate else f"closed c={a.concurrency}"), offered_rate=rate,
                      concurrency=a.concurrency, warmup_s=a.warmup_seconds, drain_timeout_s=a.drain_timeout,
                      metrics_urls=a.metrics_url, keep_records=not a.no_records, workload=workload_meta(a, rate))
    holder: dict = {}
    result = {"meta": _meta(a, "run"), "points": []}
    with Progress(not a.no_progress) as prog:
        try:
            pt = asyncio.run(run_point(target, specs, cfg, slo, warmup=warm, holder=holder,
                                       on_done=prog.task(cfg.label, len(specs))))
        except KeyboardInterrupt:
            result["interrupted"] = True
            gen = holder.get("gen")
            pt = summarize_point(gen, cfg, slo, interrupted=True) if gen and gen.t0 else None
    if pt:
        result["points"].append(pt)
    return _finish(result, a, "pdserve bench run")


def cmd_sweep(a) -> int:
    from pdserve.bench.runner import PointConfig, run_point, summarize_point
    from pdserve.bench.sweep import classify, find_knee, rate_schedule
    rates = [float(x) for x in a.rates.split(",")] if a.rates else None
    target, slo = make_target(a), make_slo(a)
    result = {"meta": _meta(a, "sweep"), "points": []}
    broken_seen = False
    with Progress(not a.no_progress) as prog:
        for i, rate in enumerate(rate_schedule(rates, a.rate_start, a.rate_factor, a.max_points)):
            warm, specs = make_specs(a, rate, seed_offset=1000 * i)
            cfg = PointConfig(label=f"{rate:g} req/s", offered_rate=rate, warmup_s=a.warmup_seconds,
                              drain_timeout_s=a.drain_timeout, metrics_urls=a.metrics_url,
                              keep_records=not a.no_records, workload=workload_meta(a, rate))
            holder: dict = {}
            try:
                pt = asyncio.run(run_point(target, specs, cfg, slo, warmup=warm if not result["points"] else [],
                                           holder=holder, on_done=prog.task(cfg.label, len(specs))))
            except KeyboardInterrupt:
                result["interrupted"] = True
                gen = holder.get("gen")
                if gen and gen.t0:
                    result["points"].append(summarize_point(gen, cfg, slo, interrupted=True))
                break
            result["points"].append(pt)
            broken = bool(classify(pt, a.slo_ttft, a.attainment_target, a.saturation_ratio))
            if rates is None and broken:
                if broken_seen:
                    break  # two points past the knee: saturation located
                broken_seen = True
    result["knee"] = find_knee(result["points"], a.slo_ttft, a.attainment_target, a.saturation_ratio)
    return _finish(result, a, "pdserve bench sweep")


def cmd_breakeven(a) -> int:
    from pdserve.bench.breakeven import run_breakeven
    return run_breakeven(a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve")
    sub = ap.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    a = ap.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return a.func(a) or 0
