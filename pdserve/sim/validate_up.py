"""Validation against a real `pdserve up` deployment (`pdserve sim validate --against up`).

Per mode (colocated: one `both` worker; disagg: one prefill + one decode worker; `--threads 1` per worker, the
given model) one deployment is started with `pdserve.bench.breakeven.Deployment`, and each cell of the grid
(prompt length x arrival rate, fixed output length) is an open-loop `pdserve bench` load point
(`pdserve.bench.runner.run_point`, streaming HTTP through gateway, router and workers). The simulator runs the
same seeded schedule on the same topology (1 `both`, or 1P + 1D), the same KV blocks and `max_num_seqs`, with
the gateway's admission in the loop and the calibrated cost model; error per cell on mean TTFT and mean TPOT.
The cost model is profiled on the engine alone; three probe requests on each fresh deployment price what a served
step costs beyond that (`serving_overhead`), and the simulated steps carry it.

What the simulator leaves out here, and so shows up as error: HTTP/SSE and gRPC hops (client -> gateway ->
router -> worker, a few ms per request on this box), the served step's cost beyond the probe's (it is priced at
one stream), and NIXL's real transfer time (the calibrated link is a memcpy bandwidth + a 5 ms handoff allowance).
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics

from pdserve.engine.config import EngineConfig
from pdserve.sim.admission import AdmissionSpec
from pdserve.sim.cluster import Cluster, ClusterSpec
from pdserve.sim.validate import _f
from pdserve.sim.workload import SLO

MODES = ("colocated", "disagg")


def cell_specs(prompt_len: int, output_len: int, rate: float, n: int, seed: int, token_range=(3, 250)) -> list:
    """bench's seeded open-loop schedule with token-id prompts (exact lengths), as `bench breakeven` makes it."""
    from pdserve.bench.workload import LengthDist, PromptMaker, synthetic
    return synthetic(n, rate, LengthDist("fixed", prompt_len), LengthDist("fixed", output_len), seed=seed,
                     maker=PromptMaker("ids", token_range))


def start(model: str, mode: str, num_gpu_blocks: int, max_num_seqs: int, ready_timeout: float = 180.0):
    from pdserve.bench.breakeven import Deployment
    extra = ["--threads", "1", "--num-gpu-blocks", str(num_gpu_blocks), "--max-num-seqs", str(max_num_seqs)]
    extra += ["--prefill", "1", "--decode", "1"] if mode == "disagg" else ["--workers", "1"]
    return Deployment(model, mode, 1, extra, ready_timeout)


def measure(dep, specs, slo: SLO, label: str, warmup: list = ()) -> dict:
    """One bench load point against the deployment; the bench point dict (records kept for the report)."""
    from pdserve.bench.client import Target
    from pdserve.bench.runner import PointConfig, run_point
    target = Target(dep.base_url, None, "completions", ignore_eos=True, timeout_s=60)
    rate = len(specs) / max(specs[-1].arrival, 1e-9) if len(specs) > 1 else None
    cfg = PointConfig(label=label, offered_rate=rate, drain_timeout_s=30.0, metrics_urls=dep.metrics_urls())
    return asyncio.run(run_point(target, specs, cfg, slo, warmup=list(warmup)))


def simulate(cost, specs, mode: str, num_blocks: int, max_num_seqs: int, slo: SLO) -> dict:
    pools = {"colocated": 1} if mode == "colocated" else {"prefill": 1, "decode": 1}
    spec = ClusterSpec(**pools, num_blocks=num_blocks, engine=EngineConfig(max_num_seqs=max_num_seqs),
                       admission=AdmissionSpec())
    c = Cluster(spec, cost, vocab_size=4096)
    c.run(specs)
    return c.summary(slo)


def serving_overhead(dep, cost, mode: str, num_blocks: int, max_num_seqs: int, slo: SLO, seed: int = 0,
                     tokens: int = 48, probes: int = 3) -> float:
    """Seconds a step of the served worker takes beyond the profiled in-process step: `probes` streamed requests
    one after another, each alone on the deployment (prompt 32, `tokens` out); the median of their client TPOTs
    minus the simulated one (>= 0). The cost model is profiled on the engine alone; a served worker also runs
    its event loop and gRPC stream per step, sharing the GIL with the engine thread (1.7x the in-process time per
    token at one stream on a Zen 5), and the probes price that the way `profile` prices the steps: on this box,
    just before the cells."""
    real = []
    for k in range(probes):
        probe = cell_specs(32, tokens, 0.0, 1, seed + 2 * k)
        warm = cell_specs(32, 8, 0.0, 1, seed + 2 * k + 1) if k == 0 else ()
        tpot = measure(dep, probe, slo, f"serving-overhead probe {k}", warmup=warm)["steady"]["latency"]["tpot_s"]
        if tpot.get("mean") is not None:
            real.append(tpot["mean"])
    sim = simulate(cost, cell_specs(32, tokens, 0.0, 1, seed), mode, num_blocks, max_num_seqs, slo)
    p = sim["latency"]["tpot_s"].get("mean")
    return max(0.0, statistics.median(real) - p) if real and p is not None else 0.0


def served(cost, step_overhead_s: float):
    """The cost model with the serving path's per-step overhead added to its fixed per-step term."""
    return dataclasses.replace(cost, a=cost.a + step_overhead_s,
                               meta={**cost.meta, "serving_overhead_s": step_overhead_s})


def _err(pred, real):
    return None if pred is None or not real else (pred - real) / real


def compare(real: dict, sim: dict, stages: dict | None = None) -> dict:
    """Errors on the client's mean TTFT / TPOT. `frontend_s` (from the servers' histograms: client -> gateway +
    route / RPC / other) is the part of the real TTFT the simulator does not model."""
    out = {}
    for m in ("ttft_s", "tpot_s"):
        a, b = sim["latency"][m].get("mean"), real["latency"][m].get("mean")
        out[f"{m}_mean_real"], out[f"{m}_mean_sim"], out[f"{m}_mean_err"] = b, a, _err(a, b)
    out["n_ok_real"], out["n_ok_sim"] = real["n_ok"], sim["n_ok"]
    out["attainment_real"] = real["slo"]["attainment_ratio"]
    out["attainment_sim"] = sim["slo"]["attainment_ratio"]
    st = stages or {}
    fe = [st.get(k) for k in ("client_to_gateway_s", "route_rpc_other_s")]
    out["frontend_s"] = sum(fe) if all(x is not None for x in fe) else None
    out["kv_transfer_real_s"] = st.get("kv_transfer_s") or None
    return out


def grid(model: str, cost, prompt_lens, rates, output_len: int, duration: float, slo: SLO,
         modes=MODES, num_gpu_blocks: int = 2048, max_num_seqs: int = 64, min_requests: int = 8, seed: int = 0,
         log=None) -> list[dict]:
    """Rows per (mode, prompt length, rate). One deployment per mode, started fresh, warmed with two requests."""
    rows = []
    for mode in modes:
        dep = start(model, mode, num_gpu_blocks, max_num_seqs)
        try:
            over = serving_overhead(dep, cost, mode, num_gpu_blocks, max_num_seqs, slo, seed + 998_000)
            mcost = served(cost, over)
            if log:
                log(f"{mode}: served step overhead {over * 1e3:.2f} ms (median of the probes), "
                    "added to the simulated steps")
            for ci, (pl, r) in enumerate((pl, r) for pl in prompt_lens for r in rates):
                n = max(min_requests, int(round(r * duration)))
                specs = cell_specs(pl, output_len, r, n, seed + 1000 * (ci + 1))  # fresh prompts: no cache hits
                warm = cell_specs(pl, output_len, 0.0, 2, seed + 999_000 + ci)
                real = measure(dep, specs, slo, f"{mode} P={pl} {r:g}/s", warmup=warm)
                sim = simulate(mcost, specs, mode, num_gpu_blocks, max_num_seqs, slo)
                row = {"mode": mode, "prompt_len": pl, "output_len": output_len, "rate": r, "n": n,
                       "serving_overhead_s": over,
                       **compare(real["steady"], sim, real.get("stage_breakdown_mean_s")),
                       "admission_sim": sim.get("admission")}
                rows.append(row)
                if log:
                    log(format_row(row))
        finally:
            dep.stop()
    return rows


def format_header() -> str:
    return (f"{'mode':>9} {'prompt':>6} {'rate':>5} | {'TTFT real':>9} {'sim':>6} {'err':>6} | "
            f"{'TPOT real':>9} {'sim':>6} {'err':>6} | ok real/sim | front-end s (real, not simulated)")


def format_row(r: dict) -> str:
    return (f"{r['mode']:>9} {r['prompt_len']:6d} {r['rate']:5g} | {_f(r['ttft_s_mean_real']):>9} "
            f"{_f(r['ttft_s_mean_sim'])} {_f(r['ttft_s_mean_err'], True)} | {_f(r['tpot_s_mean_real']):>9} "
            f"{_f(r['tpot_s_mean_sim'])} {_f(r['tpot_s_mean_err'], True)} | {r['n_ok_real']}/{r['n_ok_sim']} | "
            f"{_f(r.get('frontend_s'))}")


def markdown_table(rows: list[dict]) -> str:
    """| prompt | rate | colocated TTFT real/sim/err | TPOT ... | disagg TTFT ... | TPOT ... | (docs/sim.md)"""
    def cell(r, m):
        if r is None:
            return "n/a"
        e = r[f"{m}_mean_err"]
        return (f"{_f(r[f'{m}_mean_real']).strip()} / {_f(r[f'{m}_mean_sim']).strip()} / "
                f"{'n/a' if e is None else f'{e:+.0%}'}")
    by = {(r["mode"], r["prompt_len"], r["rate"]): r for r in rows}
    keys = sorted({(r["prompt_len"], r["rate"]) for r in rows})
    def fe(r):
        return "n/a" if r is None or r.get("frontend_s") is None else f"{r['frontend_s']:.3f}"
    out = ["| prompt | rate | colocated TTFT real / sim / err | colocated TPOT | front-end | disagg TTFT | "
           "disagg TPOT | front-end |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for pl, rt in keys:
        c, d = by.get(("colocated", pl, rt)), by.get(("disagg", pl, rt))
        out.append(f"| {pl} | {rt:g} | {cell(c, 'ttft_s')} | {cell(c, 'tpot_s')} | {fe(c)} | {cell(d, 'ttft_s')} | "
                   f"{cell(d, 'tpot_s')} | {fe(d)} |")
    return "\n".join(out)
