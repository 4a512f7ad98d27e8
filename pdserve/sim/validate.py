"""Validation against the real engine on this machine: the break-even grid (prompt length x arrival rate), each
cell run once for real (the in-process `Engine`, colocated, open-loop arrivals on the wall clock) and once in
the simulator with the calibrated cost model; error per cell on TTFT and TPOT. The simulator also predicts the
disaggregated (1 prefill + 1 decode replica) column for the same cells, which has no real counterpart here.
"""
from __future__ import annotations

import time

from pdserve.engine.config import EngineConfig
from pdserve.sim.cluster import Cluster, ClusterSpec
from pdserve.sim.workload import SLO, ClientRecord, make_workload, summarize


def real_colocated(engine, specs) -> list:
    """Open-loop run of `specs` on a real in-process Engine: a request is added at the first step boundary after
    its scheduled arrival (what a worker's engine thread does); tokens are stamped when step() returns them."""
    from pdserve.engine.sampling_params import SamplingParams

    recs = {s.idx: ClientRecord(idx=s.idx, scheduled=s.arrival, sent=s.arrival, prompt_tokens=len(s.prompt),
                                 output_tokens=s.output_len) for s in specs}
    t0 = time.perf_counter()
    i = 0
    while i < len(specs) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(specs) and specs[i].arrival <= now:
            s = specs[i]
            engine.add_request(f"v{id(specs)}-{s.idx}", list(s.prompt),
                               SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0),
                               arrival_time=s.arrival)
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, specs[i].arrival - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        t = time.perf_counter() - t0
        for o in outs:
            r = recs[int(o.request_id.rsplit("-", 1)[1])]
            for _ in o.outputs[0].new_token_ids if o.outputs else ():
                r.emits.append(t)
            if o.finished:
                r.ok = o.state == "FINISHED" and len(r.emits) == r.output_tokens
    return [recs[s.idx] for s in specs]


def simulated(cost, specs, cfg: EngineConfig, num_blocks: int, max_model_len: int, mode: str = "colocated",
              vocab_size: int = 4096, admission=None) -> list:
    """Admission is off by default: the in-process Engine has no gateway in front of it."""
    pools = {"colocated": 1} if mode == "colocated" else {"prefill": 1, "decode": 1}
    spec = ClusterSpec(**pools, num_blocks=num_blocks, engine=cfg, max_model_len=max_model_len, report_s=0,
                       admission=admission)
    c = Cluster(spec, cost, vocab_size=vocab_size)
    c.run(specs)
    return c.records()


def _err(pred, real):
    if pred is None or real is None or real == 0:
        return None
    return (pred - real) / real


def cell(engine, cost, prompt_len: int, output_len: int, rate: float, n: int, slo: SLO, seed: int = 0,
         with_disagg: bool = True) -> dict:
    specs = make_workload(n, rate, f"fixed:{prompt_len}", f"fixed:{output_len}", seed=seed)
    cfg = engine.config
    # Warm the real engine on this cell's shapes first (other prompts, so no prefix hit): the first run of a
    # shape pays the math library's first-use costs (oneDNN primitive creation per shape), which the profile's
    # second pass does not see, and which no step of a serving worker pays after its first minutes.
    real_colocated(engine, make_workload(min(n, 4), rate, f"fixed:{prompt_len}", f"fixed:{output_len}",
                                         seed=seed + 7919))
    real = summarize(real_colocated(engine, specs), slo)
    sim = summarize(simulated(cost, specs, cfg, engine.block_manager.num_blocks, engine.max_model_len), slo)
    out = {"prompt_len": prompt_len, "output_len": output_len, "rate": rate, "n": n}
    for m in ("ttft_s", "tpot_s"):
        for q in ("mean", "p90"):
            a, b = sim["latency"][m].get(q), real["latency"][m].get(q)
            out[f"{m}_{q}_real"], out[f"{m}_{q}_sim"], out[f"{m}_{q}_err"] = b, a, _err(a, b)
    out["attainment_real"] = real["slo"]["attainment_ratio"]
    out["attainment_sim"] = sim["slo"]["attainment_ratio"]
    out["goodput_real"] = real["slo"]["goodput_req_per_s"]
    out["goodput_sim"] = sim["slo"]["goodput_req_per_s"]
    if with_disagg:
        dis = summarize(simulated(cost, specs, cfg, engine.block_manager.num_blocks, engine.max_model_len,
                                  "disagg"), slo)
        out["disagg_sim_goodput"] = dis["slo"]["goodput_req_per_s"]
        out["disagg_sim_ttft_mean"] = dis["latency"]["ttft_s"].get("mean")
        out["disagg_sim_tpot_mean"] = dis["latency"]["tpot_s"].get("mean")
    return out


def grid(engine, cost, prompt_lens, rates, output_len: int, duration: float, slo: SLO, seed: int = 0,
         min_requests: int = 8, log=None) -> list[dict]:
    rows = []
    for pl in prompt_lens:
        for r in rates:
            n = max(min_requests, int(round(r * duration)))
            row = cell(engine, cost, pl, output_len, r, n, slo, seed)
            rows.append(row)
            if log:
                log(format_row(row))
    return rows


def _f(x, pct=False):
    if x is None:
        return "   n/a"
    return f"{x:+6.0%}" if pct else f"{x:6.3f}"


def format_header() -> str:
    return (f"{'prompt':>6} {'rate':>5} | {'TTFT real':>9} {'sim':>6} {'err':>6} | {'TPOT real':>9} {'sim':>6} "
            f"{'err':>6} | {'attain r/s':>10} | disagg(sim) goodput vs colocated(sim)")


def format_row(r: dict) -> str:
    return (f"{r['prompt_len']:6d} {r['rate']:5g} | {_f(r['ttft_s_mean_real']):>9} {_f(r['ttft_s_mean_sim'])} "
            f"{_f(r['ttft_s_mean_err'], True)} | {_f(r['tpot_s_mean_real']):>9} {_f(r['tpot_s_mean_sim'])} "
            f"{_f(r['tpot_s_mean_err'], True)} | {r['attainment_real']:4.2f}/{r['attainment_sim']:4.2f} | "
            f"{r.get('disagg_sim_goodput', float('nan')):.3g} vs {r['goodput_sim']:.3g} req/s")
