"""One load point: schedule -> LoadGen -> summary dict (the unit `run`, `sweep` and `breakeven` build on)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdserve.bench import metrics as MX
from pdserve.bench import stages as ST
from pdserve.bench.client import LoadGen, Target
from pdserve.bench.promscrape import breakdown, scrape, stage_means, worker_ready
from pdserve.bench.workload import RequestSpec


@dataclass
class PointConfig:
    label: str = ""
    offered_rate: float | None = None      # req/s (open loop); None for closed loop
    concurrency: int | None = None         # closed loop when set
    warmup_s: float = 0.0                  # scheduled arrivals before this are warm-up, reported apart
    drain_timeout_s: float = 60.0
    metrics_urls: list[str] = field(default_factory=list)
    keep_records: bool = True
    workload: dict = field(default_factory=dict)


def record_row(r: MX.ClientRecord, t0: float) -> dict:
    return {"idx": r.idx, "tenant": r.tenant, "scheduled_s": r.scheduled - t0,
            "send_lag_s": MX.send_lag(r), "ttft_s": MX.ttft(r), "tpot_s": MX.tpot(r), "e2e_s": MX.e2e(r),
            "itl_s": MX.itls(r), "n_out": r.n_out, "n_emits": len(r.emits), "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "ok": r.ok, "error": r.error, "warmup": r.warmup, "stages": r.stages,
            "path": r.path}


def summarize_point(gen: LoadGen, cfg: PointConfig, slo: MX.SLO, *, interrupted: bool = False,
                    stages: dict | None = None, wall_s: float | None = None) -> dict:
    t0 = gen.t0 or 0.0
    recs = list(gen.records)
    warm_sched = [r for r in recs if r.scheduled - t0 < cfg.warmup_s]
    for r in warm_sched:
        r.warmup = True
    steady = [r for r in recs if not r.warmup]
    pre = gen.warmup_records
    first = pre[0] if pre else (min(recs, key=lambda r: r.scheduled) if recs else None)
    warm = {"n_pre_run": len(pre), "n_scheduled_warmup": len(warm_sched),
            "cold_start_ttft_s": MX.ttft(first) if first else None,
            "cold_start_e2e_s": MX.e2e(first) if first else None,
            "cold_start_note": "first request of this run; a truly cold server only if it just started",
            "latency": MX.latency_summary(pre + warm_sched) if (pre or warm_sched) else None}
    summ = MX.summarize(steady, slo)
    out = {"label": cfg.label, "mode": gen.mode, "offered_rate_req_per_s": cfg.offered_rate,
           "concurrency": cfg.concurrency, "workload": cfg.workload, "interrupted": interrupted,
           "wall_s": wall_s, "steady": summ, "warmup": warm,
           "client": gen.health.as_dict() if gen.health else None, "paths": MX.path_counts(steady)}
    if stages is not None:
        out["server_stages"] = stages
        out["stage_breakdown_mean_s"] = breakdown(stages, summ["latency"]["ttft_s"].get("mean"))
        out["stage_breakdown_source"] = "prometheus_means"
    dist = ST.distributions(steady)
    if dist is not None:  # per-request stage times from the responses beat the histograms' means
        out["stage_distributions_s"] = dist
        out["stage_breakdown_mean_s"] = ST.breakdown_from(dist)
        out["stage_breakdown_source"] = "per_request"
    if cfg.keep_records:
        out["records"] = [record_row(r, t0) for r in pre + recs]
    return out


async def run_point(target: Target, specs: list[RequestSpec], cfg: PointConfig, slo: MX.SLO, *,
                    warmup: list[RequestSpec] = (), on_done=None, holder: dict | None = None) -> dict:
    """Run one load point. `holder['gen']` exposes the LoadGen so a caller can summarise after Ctrl-C."""
    gen = LoadGen(target, on_done=on_done)
    if holder is not None:
        holder["gen"] = gen
    await gen.warmup(list(warmup))
    before = await asyncio.to_thread(scrape, cfg.metrics_urls) if cfg.metrics_urls else None
    w0 = time.perf_counter()
    if cfg.concurrency:
        await gen.run_closed(specs, cfg.concurrency, drain_timeout_s=cfg.drain_timeout_s)
    else:
        await gen.run_open(specs, drain_timeout_s=cfg.drain_timeout_s)
    wall = time.perf_counter() - w0
    stages = None
    if before is not None:
        after = await asyncio.to_thread(scrape, cfg.metrics_urls)
        stages = stage_means(before, after)
    out = summarize_point(gen, cfg, slo, stages=stages, wall_s=wall)
    if cfg.metrics_urls:  # the server side of the cold start, next to the client's first-request figures
        out["warmup"]["worker_ready_s"] = await asyncio.to_thread(worker_ready, cfg.metrics_urls) or None
    return out
