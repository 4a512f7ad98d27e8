"""`pdserve bench breakeven`: colocated vs disaggregated on the same cores; where does disaggregation pay off?

For each mode, one `pdserve up` deployment; after it is ready its worker processes (every thread) are pinned
with sched_setaffinity and each worker's torch pool is sized by OMP_NUM_THREADS in its environment:
  colocated "1x2": one `both` worker, 2 threads, cores {0,1}
  colocated "2x1": two `both` workers, 1 thread each, cores {0} and {1}
  disagg:          one prefill worker on core {0} + one decode worker on core {1}, 1 thread each
Gateway, router and redis float over the same cores in both modes (and so does the load generator: this is a
2-core box; the client's own lag is reported). Grid: prompt length x offered rate (x output length); per cell an
open-loop Poisson run; goodput under the SLO per mode; KV transfer cost from `pdserve_kv_transfer_seconds`;
prefill-decode interference as decode ITL at load over the isolated-decode ITL of the same deployment.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path

from pdserve.bench import metrics as MX
from pdserve.services.up_process import UpProcess

ROOT = str(Path(__file__).resolve().parents[2])


def add_args(p) -> None:
    p.add_argument("--model", default="builtin", help="checkpoint dir or 'builtin'")
    p.add_argument("--prompt-lens", default="32,512", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--output-lens", default="16,64", help="comma-separated output lengths (tokens)")
    p.add_argument("--rates", default="2,6,12", help="comma-separated offered rates (req/s)")
    p.add_argument("--cell-duration", type=float, default=6.0, help="seconds of arrivals per cell")
    p.add_argument("--min-requests-per-cell", type=int, default=12)
    p.add_argument("--requests-per-cell", type=int, default=None, help="fixed count (overrides --cell-duration)")
    p.add_argument("--no-paired-ttft", action="store_true",
                   help="skip the paired TTFT phase (every mode's deployment up at once, the isolated requests "
                        "alternated between them) that the TTFT-overhead target prefers")
    p.add_argument("--isolated-requests", type=int, default=9,
                   help="requests sent one at a time per (prompt, output) before the cells: the unloaded TTFT the "
                        "TTFT-overhead target compares (their p50) and the isolated ITL the interference ratio uses")
    p.add_argument("--modes", default="colocated,disagg,auto",
                   help="colocated, disagg (always P -> D) and auto (the router picks per request, same pools)")
    p.add_argument("--colocated-layout", choices=["1x2", "2x1"], default="1x2",
                   help="1x2: one worker with 2 threads on both cores; 2x1: two 1-thread replicas, one per core")
    p.add_argument("--cores", default="0,1", help="the two cores to use")
    p.add_argument("--no-pin", action="store_true", help="do not pin workers (threads still set)")
    p.add_argument("--slo-ttft", type=float, default=0.5, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="seconds")
    p.add_argument("--token-range", default="3:250", help="LO:HI prompt token ids (inside the model's vocab)")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--link", action="append", default=[], metavar="RATE[,delay=MS,...]",
                   help="the link axis: run the disaggregated and auto deployments on emulated hosts (`pdserve lab`, "
                        "root) over this link, once per --link given (e.g. --link 10gbit --link 1gbit --link 100mbit);"
                        " colocated runs once, on one host. Unset: every mode on one host")
    p.add_argument("--no-sim", action="store_true", help="no simulator prediction of the cells")
    p.add_argument("--sim-costs", default=None, metavar="DIR",
                   help="reuse costs_t1.json / costs_t2.json (`pdserve sim profile --threads N`) from DIR instead of "
                        "profiling the engine before the runs")
    p.add_argument("--out", default="bench-breakeven")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--replot", default=None, metavar="BREAKEVEN_JSON",
                   help="re-render the comparison, heat map and HTML from an earlier breakeven.json (no runs); with "
                        "--sim-costs DIR, also predict its cells again with those cost models")


def _slug(run: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in run)


def _csv(s: str, kind=float) -> list:
    return [kind(x) for x in str(s).split(",") if x.strip()]


# ---- deployments -------------------------------------------------------------------------------------------
def pin(pid: int, cores: set[int]) -> int:
    """Pin every thread of a process; returns how many threads were pinned."""
    n = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
            n += 1
        except OSError:
            pass
    return n


class Deployment(UpProcess):
    """`pdserve up` for one mode of the study, with its threads capped through the OpenMP/MKL environment."""

    def __init__(self, model: str, mode: str, threads: int, extra: list[str], ready_timeout: float):
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["OMP_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
        env.setdefault("PDSERVE_LOG_LEVEL", "WARNING")
        super().__init__(["--model", model, "--mode", mode, *extra], env, ready_timeout)


class LabDeployment:
    """The disaggregated deployment on emulated hosts (pdserve/lab), with the surface `run_mode` uses."""

    def __init__(self, model: str, link: str, extra: list[str], ready_timeout: float, mode: str = "disagg"):
        from pdserve.lab.cluster import LabCluster, LabSpec
        from pdserve.lab.netns import Link
        env = {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        if "PDSERVE_LOG_LEVEL" not in os.environ:  # quiet unless asked (as the one-host deployments)
            env["PDSERVE_LOG_LEVEL"] = "WARNING"
        self.lab = LabCluster(LabSpec(model=model, mode=mode, link=Link.parse(link),
                                      engine_args=(*extra, "--threads", "1"), env=env))
        self.cmd = ["pdserve", "lab", "--mode", mode, "--link", link, *extra]
        try:
            self.lab.start(ready_timeout)
        except BaseException:
            self.lab.close()
            raise
        self.base_url = self.lab.base_url

    def workers(self) -> list[dict]:
        return [p for p in self.lab.processes() if p["role"]]

    def metrics_urls(self) -> list[str]:
        return [self.lab.metrics_url("gateway")] + [self.lab.metrics_url(w["name"]) for w in self.workers()]

    def stop(self) -> None:
        self.lab.close()


def start_mode(a, mode: str) -> tuple[Deployment, dict]:
    cores = _csv(a.cores, int)
    extra = []
    if a.num_gpu_blocks:
        extra += ["--num-gpu-blocks", str(a.num_gpu_blocks)]
    if a.max_num_seqs:
        extra += ["--max-num-seqs", str(a.max_num_seqs)]
    base = mode.split("@", 1)[0]
    if "@" in mode:  # the link axis: P and D on emulated hosts over the link
        link = mode.split("@", 1)[1]
        d = LabDeployment(a.model, link, extra, a.ready_timeout, base)
        plan = {w["name"]: {cores[0]} if w["role"] == "prefill" else {cores[1]} for w in d.workers()}
        layout = f"1 prefill host (core {cores[0]}) + 1 decode host (core {cores[1]}) over {link}, 1 thread each"
    elif base in ("disagg", "auto"):
        d = Deployment(a.model, base, 1, extra + ["--prefill", "1", "--decode", "1"], a.ready_timeout)
        plan = {w["name"]: {cores[0]} if w["role"] == "prefill" else {cores[1]} for w in d.workers()}
        layout = f"1 prefill (core {cores[0]}) + 1 decode (core {cores[1]}), 1 thread each, router {base}"
    elif a.colocated_layout == "2x1":
        d = Deployment(a.model, "colocated", 1, extra + ["--workers", "2"], a.ready_timeout)
        plan = {w["name"]: {cores[i % len(cores)]} for i, w in enumerate(d.workers())}
        layout = "2 colocated replicas, 1 thread each, one per core"
    else:
        d = Deployment(a.model, "colocated", len(cores), extra + ["--workers", "1"], a.ready_timeout)
        plan = {w["name"]: set(cores) for w in d.workers()}
        layout = f"1 colocated worker, {len(cores)} threads on cores {sorted(cores)}"
    pinned = {}
    if not a.no_pin:
        for w in d.workers():
            pinned[w["name"]] = {"cores": sorted(plan[w["name"]]), "threads_pinned": pin(w["pid"], plan[w["name"]])}
    return d, {"mode": mode, "layout": layout, "pinning": pinned or "off", "cmd": d.cmd}


# ---- measurement -------------------------------------------------------------------------------------------
def _specs(a, plen: int, olen: int, rate: float, n: int, seed: int):
    from pdserve.bench.workload import LengthDist, PromptMaker, synthetic
    lo, hi = _csv(a.token_range.replace(":", ","), int)
    return synthetic(n, rate, LengthDist("fixed", plen), LengthDist("fixed", olen), seed=seed,
                     maker=PromptMaker("ids", (lo, hi)))


def cell_specs(a, plen: int, olen: int, rate: float, ci: int | None):
    """Cell `ci`'s seeded schedule (a fresh seed per cell, the same in every mode: repeated prompts would hit the
    prefix cache); `ci` None: the isolated requests of (plen, olen), distinct prompts, the same in every mode."""
    if ci is None:
        return _specs(a, plen, olen, 0.0, max(1, a.isolated_requests), a.seed + 100_000 + 7 * plen + 13 * olen)
    n = a.requests_per_cell or max(a.min_requests_per_cell, round(rate * a.cell_duration))
    return _specs(a, plen, olen, rate, n, a.seed + 1000 * (ci + 1))


async def _isolated(target, a, plen, olen) -> dict:
    """Requests one at a time (after warm-up): the deployment's unloaded TTFT and decode ITL. Their p50 over
    several distinct prompts, so that one request's scheduling noise on a shared box (+-25 ms seen) is not read
    as the deployment's overhead."""
    from pdserve.bench.runner import PointConfig, run_point
    s0 = a.seed + 100_000 + 7 * plen + 13 * olen  # distinct from the cells and from other (P, O)
    specs = cell_specs(a, plen, olen, 0.0, None)
    pt = await run_point(target, specs, PointConfig(keep_records=False, concurrency=1), MX.SLO(a.slo_ttft, a.slo_tpot),
                         warmup=_specs(a, plen, olen, 0.0, 2, s0 + 1))
    L = pt["steady"]["latency"]
    return {"ttft_s": L["ttft_s"].get("p50"), "ttft_p90_s": L["ttft_s"].get("p90"), "n": pt["steady"]["n_ok"],
            "itl_p50_s": L["itl_s"].get("p50"), "tpot_s": L["tpot_s"].get("p50")}


def _cell_row(pt: dict, iso: dict) -> dict:
    s = pt["steady"]
    L = s["latency"]
    st = pt.get("server_stages") or {}
    itl_iso = iso.get("itl_p50_s")
    return {"goodput_req_per_s": s["slo"]["goodput_req_per_s"], "attainment_ratio": s["slo"]["attainment_ratio"],
            "n_slo": s["slo"]["n_slo"], "window_s": s["throughput"]["window_s"],
            "prefix_cached_prompt_token_fraction": s.get("prefix_cached_prompt_token_fraction"),
            "request_throughput_req_per_s": s["throughput"]["request_throughput_req_per_s"],
            "output_token_throughput_tok_per_s": s["throughput"]["output_token_throughput_tok_per_s"],
            "ttft_p50_s": L["ttft_s"].get("p50"), "ttft_p99_s": L["ttft_s"].get("p99"),
            "itl_p50_s": L["itl_s"].get("p50"), "itl_p99_s": L["itl_s"].get("p99"),
            "tpot_p50_s": L["tpot_s"].get("p50"), "tpot_p99_s": L["tpot_s"].get("p99"),
            "n": s["n_requests"], "n_ok": s["n_ok"], "errors": s["errors"],
            "kv_transfer_mean_s": st.get("kv_transfer_mean_s"), "kv_transfer_count": st.get("kv_transfer_count"),
            "kv_transfer_bytes": st.get("kv_transfer_bytes"),
            "queue_mean_s": st.get("queue_prefill_worker_mean_s") or st.get("queue_both_worker_mean_s"),
            "prefill_mean_s": st.get("prefill_prefill_worker_mean_s") or st.get("prefill_both_worker_mean_s"),
            "interference_itl_p50_over_isolated": (L["itl_s"]["p50"] / itl_iso)
            if itl_iso and L["itl_s"].get("p50") else None,
            "interference_itl_p99_over_isolated": (L["itl_s"]["p99"] / itl_iso)
            if itl_iso and L["itl_s"].get("p99") else None,
            "client_bottleneck": (pt.get("client") or {}).get("bottleneck"),
            "paths_header": pt.get("paths"), "paths_metric": st.get("requests_by_path"),
            "stage_breakdown_mean_s": pt.get("stage_breakdown_mean_s")}


def run_mode(a, mode: str, grid: list[tuple[int, int, float]], on_cell, progress, res: dict) -> dict:
    """Fills `res` as cells finish (so an interrupt keeps them)."""
    from pdserve.bench.client import Target
    from pdserve.bench.runner import PointConfig, run_point
    t_start = time.perf_counter()
    d, info = start_mode(a, mode)
    info["startup_s"] = time.perf_counter() - t_start
    res.update({"deployment": info, "isolated": {}, "cells": {}})
    try:
        target = Target(d.base_url, None, "completions", ignore_eos=True, timeout_s=60)
        for plen, olen in sorted({(p, o) for p, o, _ in grid}):
            res["isolated"][f"{plen}x{olen}"] = asyncio.run(_isolated(target, a, plen, olen))
        for ci, (plen, olen, rate) in enumerate(grid):
            specs = cell_specs(a, plen, olen, rate, ci)
            cfg = PointConfig(label=f"{mode} P={plen} O={olen} {rate:g}/s", offered_rate=rate,
                              drain_timeout_s=a.drain_timeout, metrics_urls=d.metrics_urls(), keep_records=False)
            pt = asyncio.run(run_point(target, specs, cfg, MX.SLO(a.slo_ttft, a.slo_tpot),
                                       on_done=progress(cfg.label, len(specs))))
            row = _cell_row(pt, res["isolated"][f"{plen}x{olen}"])
            res["cells"][f"{plen}x{olen}x{rate:g}"] = row
            on_cell(mode, plen, olen, rate, row)
    finally:
        d.stop()
    return res


def within_noise(n_slo_c: int, n_slo_d: int, n: int) -> bool:
    """Both modes ran the same seeded schedule of n requests. Equal N_SLO: the goodput gap is only the drain tail
    of the window. Otherwise a two-proportion test: a gap in attainment under 2 standard errors is a tie."""
    if n_slo_c == n_slo_d or n <= 0:
        return True
    pc, pd = n_slo_c / n, n_slo_d / n
    p = (pc + pd) / 2
    se = math.sqrt(max(p * (1 - p), 0.25 / n) * 2 / n)
    return abs(pd - pc) < 2 * se


def compare(results: dict, grid, disagg: str = "disagg") -> list[dict]:
    """Colocated against the disaggregated run `disagg` ("disagg" on one host, "disagg@LINK" over a link)."""
    rows = []
    link = disagg.split("@", 1)[1] if "@" in disagg else "same host"
    for plen, olen, rate in grid:
        k = f"{plen}x{olen}x{rate:g}"
        c = results.get("colocated", {}).get("cells", {}).get(k)
        g = results.get(disagg, {}).get("cells", {}).get(k)
        if not c or not g:
            continue
        gc, gd = c["goodput_req_per_s"], g["goodput_req_per_s"]
        noise = within_noise(c["n_slo"], g["n_slo"], g["n"])
        rows.append({"link": link, "prompt_len": plen, "output_len": olen, "rate_req_per_s": rate,
                     "goodput_colocated_req_per_s": gc, "goodput_disagg_req_per_s": gd,
                     "goodput_delta_req_per_s": gd - gc,
                     "goodput_ratio_disagg_over_colocated": (gd / gc) if gc else (math.inf if gd else None),
                     "n_slo_colocated": c["n_slo"], "n_slo_disagg": g["n_slo"], "n": g["n"],
                     "within_noise": noise,
                     "winner": "tie" if noise else ("disagg" if gd > gc else "colocated"),
                     "kv_transfer_mean_s": g["kv_transfer_mean_s"],
                     "kv_transfer_share_of_ttft_p50": (g["kv_transfer_mean_s"] / g["ttft_p50_s"])
                     if g["kv_transfer_mean_s"] and g["ttft_p50_s"] else None,
                     "itl_p99_colocated_s": c["itl_p99_s"], "itl_p99_disagg_s": g["itl_p99_s"],
                     "ttft_p50_colocated_s": c["ttft_p50_s"], "ttft_p50_disagg_s": g["ttft_p50_s"],
                     "interference_colocated_itl_p99_over_isolated": c["interference_itl_p99_over_isolated"],
                     "interference_disagg_itl_p99_over_isolated": g["interference_itl_p99_over_isolated"]})
    return rows


def plot_heatmap(rows: list[dict], path: Path, slo: MX.SLO) -> Path | None:
    from pdserve.bench.report import pyplot
    plt = pyplot()
    if plt is None:
        return None
    if not rows:
        return None
    olens = sorted({r["output_len"] for r in rows})
    plens = sorted({r["prompt_len"] for r in rows})
    rates = sorted({r["rate_req_per_s"] for r in rows})
    fig, axes = plt.subplots(1, len(olens), figsize=(3.2 + 1.6 * len(rates) * len(olens), 1.6 + 1.0 * len(plens)),
                             squeeze=False)
    im = None
    for ax, o in zip(axes[0], olens):
        grid = [[float("nan")] * len(rates) for _ in plens]
        for r in rows:
            if r["output_len"] != o:
                continue
            i, j = plens.index(r["prompt_len"]), rates.index(r["rate_req_per_s"])
            grid[i][j] = 0.0 if r["within_noise"] else r["goodput_delta_req_per_s"] / r["rate_req_per_s"]
            ratio = r["goodput_ratio_disagg_over_colocated"]
            rt = "–" if ratio is None else ("∞" if ratio == math.inf else f"×{ratio:.2f}")
            ax.text(j, i, f"{'≈ ' if r['within_noise'] else ''}{rt}\nD {r['goodput_disagg_req_per_s']:.2f}\n"
                          f"C {r['goodput_colocated_req_per_s']:.2f}",
                    ha="center", va="center", fontsize=8)
        im = ax.imshow(grid, cmap="RdBu", vmin=-1, vmax=1, origin="lower", aspect="auto")
        ax.set_xticks(range(len(rates)), [f"{x:g}" for x in rates])
        ax.set_yticks(range(len(plens)), [str(x) for x in plens])
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("prompt length (tokens)")
        ax.set_title(f"output {o} tokens", fontsize=10)
    fig.suptitle(f"(goodput disagg − colocated) / offered rate; blue: disagg wins\nSLO TTFT ≤ {slo.ttft}s, "
                 f"TPOT ≤ {slo.tpot}s; cells: D/C ratio (≈: within noise, a tie, drawn white), D and C goodput req/s",
                 fontsize=9, y=1.04)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_detail(results: dict, grid, path: Path) -> Path | None:
    from pdserve.bench.report import pyplot
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode in sorted(results, key=lambda m: m != "colocated"):
        style = "o-" if mode == "colocated" else "s--"
        cells = results.get(mode, {}).get("cells", {})
        for plen, olen in sorted({(p, o) for p, o, _ in grid}):
            rs = sorted(r for p, o, r in grid if p == plen and o == olen and f"{p}x{o}x{r:g}" in cells)
            if not rs:
                continue
            cs = [cells[f"{plen}x{olen}x{r:g}"] for r in rs]
            lab = f"{mode} P={plen} O={olen}"
            axes[0].plot(rs, [(c["ttft_p99_s"] or float("nan")) * 1e3 for c in cs], style, label=lab)
            axes[1].plot(rs, [(c["itl_p99_s"] or float("nan")) * 1e3 for c in cs], style, label=lab)
            if mode.startswith("disagg"):
                axes[2].plot(rs, [(c["kv_transfer_mean_s"] or float("nan")) * 1e3 for c in cs], style, label=lab)
    for ax, t in zip(axes, ("TTFT p99 (ms)", "ITL p99 (ms): interference shows here", "KV transfer mean (ms), disagg")):
        ax.set_title(t, fontsize=10)
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def verdict(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        ratio = r["goodput_ratio_disagg_over_colocated"]
        rt = "n/a (both 0)" if ratio is None else ("inf" if ratio == math.inf else f"{ratio:.2f}x")
        out.append(f"link {r.get('link', 'same host')}: P={r['prompt_len']} O={r['output_len']} "
                   f"rate={r['rate_req_per_s']:g}: "
                   f"{r['winner'].upper()}"
                   f" (goodput D {r['goodput_disagg_req_per_s']:.2f} vs C {r['goodput_colocated_req_per_s']:.2f} req/s,"
                   f" N_SLO D {r['n_slo_disagg']} vs C {r['n_slo_colocated']} of {r['n']},"
                   f" {rt}; KV transfer {(r['kv_transfer_mean_s'] or 0) * 1e3:.2f} ms/req; ITL p99 C "
                   f"{(r['itl_p99_colocated_s'] or 0) * 1e3:.1f} vs D {(r['itl_p99_disagg_s'] or 0) * 1e3:.1f} ms)")
    return out


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it (model name, family, model), for the report."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            info.setdefault(k.strip(), v.strip())
    except OSError:
        return "unknown"
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"


# The simulator's per-cell prediction (pdserve/sim/breakeven_predict.py), installed by the `pdserve` command line
# (cli.py) before it runs a bench command: the simulator builds on bench's workloads and metrics, so bench does not
# import it (no cycle between the two packages). Without it (`python -m pdserve.bench`) the cells are measured only.
PREDICTOR = None
NO_PREDICTOR = "no simulator prediction: run the study as `pdserve bench breakeven`"


def predict(a, costs, mode: str, grid, slo, res: dict) -> None:
    """The simulator's prediction of each measured cell of `mode` into its row (`sim`); a failure is reported in
    the results, never fatal to the measurements."""
    BS = PREDICTOR
    if BS is None or not res.get("cells"):
        return
    try:
        info = BS.predict_mode(costs, mode, res, grid, lambda p, o, r, ci: cell_specs(a, p, o, r, ci), slo,
                               colocated_layout=a.colocated_layout, num_gpu_blocks=a.num_gpu_blocks,
                               max_num_seqs=a.max_num_seqs or 64)
        print(f"sim {mode}: {info}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 (the prediction is an extra; the measured cells stand)
        res["sim"] = {"error": f"{type(e).__name__}: {e}"}
        print(f"sim {mode}: prediction failed: {e}", file=sys.stderr)


def _original_args(argv: list[str]):
    """The study's own options from its recorded argv (what `--replot` needs to rebuild its workloads)."""
    import argparse
    p = argparse.ArgumentParser()
    add_args(p)
    i = argv.index("breakeven") + 1 if "breakeven" in argv else 0
    return p.parse_known_args(argv[i:])[0]


def repredict(a, costs_dir: str, out: Path, grid, slo, results: dict) -> None:
    BS = PREDICTOR
    if BS is None:
        raise SystemExit(NO_PREDICTOR)
    costs = BS.costs(a.model, BS.threads_needed(list(results), a.colocated_layout), out, costs_dir,
                     log=lambda m: print(m, file=sys.stderr))
    for mode, res in results.items():
        predict(a, costs, mode, grid, slo, res)


def sim_costs(a, modes: list[str], out: Path, meta: dict) -> dict | None:
    """The cost models the prediction needs (profiled now, or from --sim-costs), recorded in `meta`; None, with
    the reason in `meta`, where there are none: the measurements never depend on them."""
    BS = PREDICTOR
    if BS is None:
        meta["sim_error"] = NO_PREDICTOR
        print(f"sim: {NO_PREDICTOR}", file=sys.stderr)
        return None
    try:
        costs = BS.costs(a.model, BS.threads_needed(modes, a.colocated_layout), out, a.sim_costs,
                         log=lambda m: print(m, file=sys.stderr))
    except Exception as e:  # noqa: BLE001 (e.g. a model whose context is shorter than the profile's grid)
        meta["sim_error"] = f"{type(e).__name__}: {e}"
        print(f"sim: no cost model, so no prediction ({meta['sim_error']})", file=sys.stderr)
        return None
    meta["sim_costs"] = {n: c.to_json() for n, c in costs.items()}
    return costs


def run_breakeven(a) -> int:
    from pdserve.bench.progress import Progress
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = [(p, o, r) for o in _csv(a.output_lens, int) for p in _csv(a.prompt_lens, int) for r in _csv(a.rates)]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if a.link:  # the link axis: disaggregated and auto once per link, on emulated hosts
        modes = [m for m in modes if m not in ("disagg", "auto")] + \
            [f"{m}@{link}" for link in a.link for m in ("disagg", "auto") if m in modes]
    slo = MX.SLO(a.slo_ttft, a.slo_tpot)
    results: dict = {}
    meta = {"kind": "breakeven", "argv": sys.argv[1:], "grid": {"prompt_lens": a.prompt_lens,
            "output_lens": a.output_lens, "rates": a.rates, "requests_per_cell": a.requests_per_cell,
            "cell_duration_s": a.cell_duration, "min_requests_per_cell": a.min_requests_per_cell},
            "slo": slo.as_dict(), "model": a.model, "cpu_count": os.cpu_count(), "cpu": cpu_name(),
            "links": a.link, "colocated_layout": a.colocated_layout, "seed": a.seed,
            "note": "load generator, gateway, router and redis share the same cores as the workers"}
    interrupted = False
    t0 = time.perf_counter()

    def on_cell(mode, plen, olen, rate, row):
        print(f"[{time.perf_counter() - t0:6.1f}s] {mode:9s} P={plen:<5d} O={olen:<4d} rate={rate:<5g} goodput "
              f"{row['goodput_req_per_s']:.2f} req/s attain {row['attainment_ratio']:.2f} TTFT p50 "
              f"{(row['ttft_p50_s'] or 0) * 1e3:.0f} ms ITL p99 {(row['itl_p99_s'] or 0) * 1e3:.1f} ms KV "
              f"{(row['kv_transfer_mean_s'] or 0) * 1e3:.2f} ms", file=sys.stderr, flush=True)

    if a.replot:
        old = json.loads(Path(a.replot).read_text())
        results, meta = old["results"], {**old["meta"], "replotted_from": a.replot}
        g = old["meta"]["grid"]
        grid = [(p, o, r) for o in _csv(g["output_lens"], int) for p in _csv(g["prompt_lens"], int) for r in _csv(g["rates"])]
        slo = MX.SLO(old["meta"]["slo"]["ttft_s"], old["meta"]["slo"]["tpot_s"])
        interrupted = old.get("interrupted", False)
        modes = []
        if a.sim_costs and not a.no_sim:
            repredict(_original_args(meta.get("argv", [])), a.sim_costs, out, grid, slo, results)
    costs = sim_costs(a, modes, out, meta) if modes and not a.no_sim else None
    if modes and not a.no_paired_ttft and "colocated" in modes and any(m.startswith("disagg") for m in modes):
        from pdserve.bench import breakeven_paired
        paired = breakeven_paired.measure(a, modes, sorted({(p, o) for p, o, _ in grid}))
        for mode, iso in paired.items():
            results.setdefault(mode, {})["isolated_paired"] = iso
    with Progress(not a.no_progress) as prog:
        for mode in modes:
            try:
                run_mode(a, mode, grid, on_cell, prog.task, results.setdefault(mode, {}))
            except KeyboardInterrupt:
                interrupted = True
                print("interrupted: reporting what was measured so far", file=sys.stderr)
                break
            finally:
                if costs and not interrupted:
                    predict(a, costs, mode, grid, slo, results.get(mode, {}))
    files, lines = write_report(out, results, meta, grid, slo, interrupted, time.perf_counter() - t0)
    for x in lines:
        print(x, file=sys.stderr)
    for k, v in files.items():
        print(f"{k}: {v}")
    return 130 if interrupted else 0


def write_report(out: Path, results: dict, meta: dict, grid, slo, interrupted: bool, wall_s: float):
    """breakeven.json, the heat maps, the detail plot, the table and the HTML; (files, verdict lines)."""
    import html as H

    from pdserve.bench import breakeven_report as BR
    from pdserve.bench import breakeven_targets as BT
    from pdserve.bench.report import _clean, _img, write_html, write_json
    runs = [m for m in results if m.startswith("disagg")]
    by_run = {m: compare(results, grid, m) for m in runs}
    rows = [r for m in runs for r in by_run[m]]
    targets = BT.summary(results, grid, meta.get("links") or [])
    result = {"meta": meta, "results": results, "comparison": rows, "targets": targets, "interrupted": interrupted,
              "wall_s": wall_s}
    files = {"json": write_json(result, out / "breakeven.json")}
    hm = None
    for m in runs:  # one heat map per link (the first is the headline)
        name = "breakeven_heatmap.png" if m == "disagg" else f"breakeven_heatmap_{_slug(m)}.png"
        png = plot_heatmap(by_run[m], out / name, slo)
        if png:
            files[f"heatmap_png_{_slug(m)}"] = png
            hm = hm or png
    dt = plot_detail(results, grid, out / "breakeven_detail.png")
    auto_png = BR.plot_auto(targets["auto_goodput"]["rows"], out / "breakeven_auto.png")
    if auto_png:
        files["auto_png"] = auto_png
    (out / "breakeven_table.md").write_text(BR.markdown(results, grid, targets))
    files["table_md"] = out / "breakeven_table.md"
    lines = verdict(rows) + BT.lines(targets)
    deps = "".join(f"<li><b>{m}</b>: {H.escape(r['deployment']['layout'])}; startup "
                   f"{r['deployment']['startup_s']:.1f} s; pinning {H.escape(json.dumps(r['deployment']['pinning']))}</li>"
                   for m, r in results.items() if "deployment" in r)
    table = ("<table><tr>" + "".join(f"<th>{k}</th>" for k in (rows[0].keys() if rows else [])) + "</tr>" +
             "".join("<tr>" + "".join(f"<td>{'' if v is None else (f'{v:.4g}' if isinstance(v, float) else v)}</td>"
                                      for v in r.values()) + "</tr>" for r in rows) + "</table>")
    sections = [("Headline: where disaggregation's goodput beats colocated", _img(hm) if hm else "<p>no comparable cells</p>"),
                *BR.html_sections(results, grid, targets),
                ("auto against the better of colocated and disaggregated", _img(auto_png) if auto_png else ""),
                ("Verdict per cell", "<ul>" + "".join(f"<li>{H.escape(x)}</li>" for x in lines) + "</ul>"),
                ("Deployments (same cores)", f"<ul>{deps}</ul>"),
                ("Latency, interference and KV transfer", _img(dt) if dt else ""),
                ("All cells", table)]
    files["html"] = write_html(out / "breakeven.html", "pdserve bench breakeven", sections, _clean(meta))
    if dt:
        files["detail_png"] = dt
    return files, lines
