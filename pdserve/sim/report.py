"""`pdserve sim run --out DIR`: the same results.json + cdf.png + report.html as `pdserve bench run`, through
bench's own report code (`pdserve.bench.report.run_report`); the simulated run is one bench load point."""
from __future__ import annotations

from pathlib import Path

from pdserve.bench.report import run_report
from pdserve.bench.runner import record_row


def sim_point(cluster, summary: dict, label: str, rate: float, keep_records: bool = True) -> dict:
    """A bench load-point dict (`runner.summarize_point`'s shape) for a simulated run: times are virtual seconds
    from the first scheduled arrival; there is no client (no send lag) and no warm-up."""
    point = {"label": label, "mode": "simulated open-loop", "offered_rate_req_per_s": rate, "concurrency": None,
             "workload": {}, "interrupted": False, "wall_s": summary.get("sim_wall_s"), "steady": summary,
             "warmup": {"n_pre_run": 0, "n_scheduled_warmup": 0, "cold_start_ttft_s": None,
                        "cold_start_e2e_s": None, "latency": None}, "client": None}
    if keep_records:
        point["records"] = [record_row(r, 0.0) for r in cluster.records()]
    return point


def write_report(out_dir: str | Path, point: dict, meta: dict) -> dict:
    """-> {kind: path} as bench's run_report returns it (json, cdf_png, html)."""
    return run_report({"meta": meta, "points": [point]}, Path(out_dir), title="pdserve sim run")
