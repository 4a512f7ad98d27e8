"""Results -> JSON, PNG plots (matplotlib, Agg) and one self-contained HTML page (images base64-inlined).

matplotlib is the `bench` extra (`pip install pdserve[bench]`): a serving install does without it, and a bench run
without it writes the JSON and the tables, with a line in place of each plot."""
from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when the `bench` extra is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt



def _clean(o):
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def write_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(result), indent=1))
    return path


def _ms(x):
    return "–" if x is None else f"{x * 1e3:.1f}"


def _f(x, nd=2):
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _point_label(p: dict) -> str:
    if p.get("label"):
        return p["label"]
    if p.get("concurrency"):
        return f"closed c={p['concurrency']}"
    return f"{p.get('offered_rate_req_per_s'):g} req/s"


# ---- plots -------------------------------------------------------------------------------------------------
def plot_cdfs(points: list[dict], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, key, title in zip(axes.flat, ("ttft_s", "itl_s", "tpot_s", "e2e_s"),
                              ("TTFT (from scheduled arrival)", "ITL (per chunk)", "TPOT (N_out ≥ 2)",
                               "E2E (to last emit)")):
        for p in points:
            rows = [r for r in p.get("records", []) if r["ok"] and not r["warmup"]]
            xs = [x for r in rows for x in r["itl_s"]] if key == "itl_s" else [r[key] for r in rows if r[key] is not None]
            if not xs:
                continue
            xs.sort()
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step([x * 1e3 for x in xs], ys, where="post", label=f"{_point_label(p)} (n={len(xs)})")
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.axhline(0.99, color="grey", lw=0.5, ls=":")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_latency_throughput(points: list[dict], path: Path, knee: dict | None = None) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    pts = [p for p in points if p.get("offered_rate_req_per_s") is not None]
    pts.sort(key=lambda p: p["offered_rate_req_per_s"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x_thr = [p["steady"]["throughput"]["output_token_throughput_tok_per_s"] for p in pts]
    for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-")):
        axes[0].plot(x_thr, [(p["steady"]["latency"]["ttft_s"].get(q) or float("nan")) * 1e3 for p in pts], style,
                     label=f"TTFT {q}")
        axes[1].plot(x_thr, [(p["steady"]["latency"]["tpot_s"].get(q) or float("nan")) * 1e3 for p in pts], style,
                     label=f"TPOT {q}")
    for ax, t in zip(axes[:2], ("TTFT vs achieved output-token throughput", "TPOT vs achieved output-token throughput")):
        ax.set_xlabel("output-token throughput (tokens/s)")
        ax.set_ylabel("ms")
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_yscale("log")
    off = [p["offered_rate_req_per_s"] for p in pts]
    axes[2].plot(off, off, ":", color="grey", label="offered")
    axes[2].plot(off, [p["steady"]["throughput"]["request_throughput_req_per_s"] for p in pts], "o-",
                 label="request throughput (req/s)")
    axes[2].plot(off, [p["steady"]["slo"]["goodput_req_per_s"] for p in pts], "s-", label="goodput (req/s under SLO)")
    ax2 = axes[2].twinx()
    ax2.plot(off, [p["steady"]["slo"]["attainment_ratio"] for p in pts], "x--", color="tab:red",
             label="SLO attainment (ratio)")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("attainment (ratio)")
    if knee and knee.get("knee_rate_req_per_s") is not None:
        axes[2].axvline(knee["knee_rate_req_per_s"], color="tab:red", ls="--", lw=1)
    axes[2].set_xlabel("offered rate (req/s)")
    axes[2].set_ylabel("req/s")
    axes[2].set_title("throughput and goodput (rates) vs offered load", fontsize=10)
    axes[2].grid(alpha=0.3)
    h1, l1 = axes[2].get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    axes[2].legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


STAGE_KEYS = ("client_to_gateway_s", "route_rpc_other_s", "queue_s", "prefill_s", "kv_transfer_s", "decode_s")


def plot_stages(points: list[dict], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    pts = [p for p in points if p.get("stage_breakdown_mean_s")]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(pts) + 3), 4))
    bottoms = [0.0] * len(pts)
    labels = [_point_label(p) for p in pts]
    for k in STAGE_KEYS:
        vals = [max(0.0, (p["stage_breakdown_mean_s"].get(k) or 0.0)) * 1e3 for p in pts]
        ax.bar(labels, vals, bottom=bottoms, label=k.replace("_s", ""))
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_ylabel("mean ms per request")
    src = {p.get("stage_breakdown_source") for p in pts}
    ax.set_title("per-stage time (means of per-request stage times)" if src == {"per_request"}
                 else "per-stage time (means; per-request where the responses carry stage times)"
                 if "per_request" in src else "per-stage time (means from server histograms)", fontsize=10)
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---- HTML --------------------------------------------------------------------------------------------------
def _img(path: Path | None) -> str:
    if not path:
        return ""
    b = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img alt="{html.escape(Path(path).name)}" src="data:image/png;base64,{b}" style="max-width:100%">'


def _ci(d: dict, q: str) -> str:
    lo, hi = (d.get(q + "_ci") or [None, None])
    return f"{_ms(d.get(q))} [{_ms(lo)}, {'n too small' if hi is None else _ms(hi)}]"


def points_table(points: list[dict]) -> str:
    head = ("<tr><th>load point</th><th>mode</th><th>n (ok)</th><th>TTFT p50 / p99 [95% CI] ms</th>"
            "<th>ITL p50 / p99 ms (n)</th><th>TPOT p50 / p99 ms</th><th>E2E p99 ms</th>"
            "<th>req/s</th><th>output tok/s</th><th>total tok/s</th><th>SLO attainment (ratio)</th>"
            "<th>goodput (req/s)</th><th>client p99 send lag ms</th><th>client bottleneck</th></tr>")
    rows = []
    for p in points:
        s = p["steady"]
        L, T, S = s["latency"], s["throughput"], s["slo"]
        c = p.get("client") or {}
        rows.append(
            f"<tr><td>{html.escape(_point_label(p))}{' (interrupted)' if p.get('interrupted') else ''}</td>"
            f"<td>{html.escape(p.get('mode', ''))}</td><td>{s['n_requests']} ({s['n_ok']})</td>"
            f"<td>{_ms(L['ttft_s'].get('p50'))} / {_ci(L['ttft_s'], 'p99')}</td>"
            f"<td>{_ms(L['itl_s'].get('p50'))} / {_ms(L['itl_s'].get('p99'))} ({L['itl_s']['n']})</td>"
            f"<td>{_ms(L['tpot_s'].get('p50'))} / {_ms(L['tpot_s'].get('p99'))}</td>"
            f"<td>{_ms(L['e2e_s'].get('p99'))}</td>"
            f"<td>{_f(T['request_throughput_req_per_s'])}</td><td>{_f(T['output_token_throughput_tok_per_s'], 1)}</td>"
            f"<td>{_f(T['total_token_throughput_tok_per_s'], 1)}</td><td>{_f(S['attainment_ratio'], 3)}</td>"
            f"<td>{_f(S['goodput_req_per_s'])}</td>"
            f"<td>{_ms((c.get('send_lag_s') or {}).get('p99'))}</td>"
            f"<td>{'YES: ' + html.escape('; '.join(c.get('reasons', []))) if c.get('bottleneck') else 'no'}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def stage_table(points: list[dict]) -> str:
    """p50 / p90 / p99 per stage and load point, from the per-request `usage.stage_times`."""
    pts = [p for p in points if p.get("stage_distributions_s")]
    if not pts:
        return ""
    rows = []
    for p in pts:
        d = p["stage_distributions_s"]
        for k, v in d.items():
            if not isinstance(v, dict) or not v.get("n"):
                continue
            rows.append(f"<tr><td>{html.escape(_point_label(p))}</td><td>{html.escape(k[:-2])}</td><td>{v['n']}</td>"
                        f"<td>{_ms(v.get('p50'))}</td><td>{_ms(v.get('p90'))}</td><td>{_ms(v.get('p99'))}</td>"
                        f"<td>{_ms(v.get('mean'))}</td></tr>")
    return ("<table><tr><th>load point</th><th>stage</th><th>n</th><th>p50 ms</th><th>p90 ms</th><th>p99 ms</th>"
            "<th>mean ms</th></tr>" + "".join(rows) + "</table>")


def warmup_table(points: list[dict]) -> str:
    rows = []
    for p in points:
        w = p.get("warmup") or {}
        rows.append(f"<tr><td>{html.escape(_point_label(p))}</td><td>{w.get('n_pre_run', 0)} + "
                    f"{w.get('n_scheduled_warmup', 0)}</td><td>{_ms(w.get('cold_start_ttft_s'))}</td>"
                    f"<td>{_ms(w.get('cold_start_e2e_s'))}</td>"
                    f"<td>{html.escape(_ready(w.get('worker_ready_s')))}</td></tr>")
    return ("<table><tr><th>load point</th><th>warm-up requests (pre-run + scheduled)</th>"
            "<th>first-request TTFT ms</th><th>first-request E2E ms</th>"
            "<th>worker cold start s (load / warm-up / ready)</th></tr>" + "".join(rows) + "</table>")


def _ready(r: dict | None) -> str:
    """pdserve_worker_ready_seconds per phase, the slowest worker's (spec §1.5)."""
    if not r:
        return "-"
    return " / ".join(f"{r[k]:.2f}" if k in r else "-" for k in ("load", "warmup", "ready"))


CSS = ("body{font-family:sans-serif;max-width:1400px;margin:2em auto;padding:0 1em}"
       "table{border-collapse:collapse;font-size:12px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px}"
       "th{background:#f3f3f3}code,pre{background:#f6f6f6;padding:2px 4px}")

DEFS = """<details><summary>Metric definitions (spec §2.1–§2.2)</summary><ul>
<li>System boundary: the load generator's clock. Arrival = the request's <b>scheduled</b> time (open loop); emit = a
content-bearing SSE chunk read by the client. Closed-loop points use the actual send time (coordinated-omission
prone) and say so in the mode column.</li>
<li>TTFT = t_first_emit − t_arrival; ITL_j = t_emit,j − t_emit,j−1 (per chunk); TPOT = (t_last − t_first)/(N_out − 1),
only for N_out ≥ 2; E2E = t_last − t_arrival = TTFT + ΣITL (identity).</li>
<li>Throughput = completed work / Δt with Δt = first scheduled arrival → last emit; request, output-token and
total-token throughput are different rates. SLO attainment = N_SLO / N_total (ratio; failed requests count as misses);
goodput = N_SLO / Δt (rate).</li>
<li>Percentile CIs: distribution-free order-statistic (binomial) intervals; “n too small” means the sample cannot bound
that side (p99 needs n ≥ 368 for an upper 95% bound).</li></ul></details>"""


def write_html(path: Path, title: str, sections: list[tuple[str, str]], meta: dict | None = None) -> Path:
    body = [f"<h1>{html.escape(title)}</h1>"]
    if meta:
        body.append("<pre>" + html.escape(json.dumps(_clean(meta), indent=1)) + "</pre>")
    body.append(DEFS)
    for h, content in sections:
        body.append(f"<h2>{html.escape(h)}</h2>{content}")
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                    f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>")
    return path


def run_report(result: dict, out_dir: Path, title: str = "pdserve bench") -> dict:
    """result = {"meta": ..., "points": [...], "knee": ... (sweep)} -> files. Returns {kind: path}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    points = result["points"]
    files = {"json": write_json(result, out_dir / "results.json")}
    cdf = plot_cdfs(points, out_dir / "cdf.png")
    if cdf:
        files["cdf_png"] = cdf
    lt = None
    if sum(1 for p in points if p.get("offered_rate_req_per_s") is not None) >= 2:
        lt = files["latency_throughput_png"] = plot_latency_throughput(points, out_dir / "latency_throughput.png",
                                                                        result.get("knee"))
    st = plot_stages(points, out_dir / "stages.png")
    if st:
        files["stages_png"] = st
    sections = [("Load points (steady state, warm-up excluded)", points_table(points))]
    if result.get("knee"):
        sections.append(("Knee", "<pre>" + html.escape(json.dumps(_clean(result["knee"]), indent=1)) + "</pre>"))
    if lt:
        sections.append(("Latency–throughput", _img(lt)))
    sections.append(("CDFs", _img(cdf) if cdf else "<p>No plots: matplotlib is not installed "
                     "(<code>pip install pdserve[bench]</code>).</p>"))
    dist = stage_table(points)
    if dist:
        sections.append(("Per-stage breakdown", (_img(st) if st else "") + "<p>Per-request distributions from each "
                         "response's <code>usage.stage_times</code> (stage definitions: docs/services.md); "
                         "client_to_gateway = client TTFT − gateway TTFT of the same request.</p>" + dist))
    elif st:
        sections.append(("Per-stage breakdown", _img(st) + "<p>Means over each load point from the servers' Prometheus "
                         "histograms (queue, prefill, KV transfer, gateway TTFT/E2E): the responses carried no "
                         "per-request stage times, so these are means, not distributions.</p>"))
    else:
        sections.append(("Per-stage breakdown", "<p>Not available: no metrics endpoints were given "
                         "(<code>--metrics-url</code>) and the responses carry no stage timestamps.</p>"))
    sections.append(("Warm-up / cold start (reported apart)", warmup_table(points)))
    files["html"] = write_html(out_dir / "report.html", title, sections, result.get("meta"))
    return files
