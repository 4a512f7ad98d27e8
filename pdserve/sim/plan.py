"""`pdserve sim plan`: the cheapest prefill/decode (or colocated) deployment meeting an SLO, sized the way spec
Q19 says:

1. goodput of ONE replica under the SLO, from a simulated load sweep (not raw throughput): the highest offered
   rate at which the SLO attainment stays >= the target. Colocated: one `both` replica against the full SLO.
   Disaggregated: one prefill replica (with decode plentiful) against the TTFT SLO, one decode replica (with
   prefill plentiful) against the TPOT SLO.
2. replicas >= target rate x peak factor / per-replica goodput, per pool (the lower bound);
3. the peak factor is the headroom: the cluster is checked at rate x peak, not at the mean rate;
4. the lower bound is then checked by simulating the whole cluster at the peak rate and grown (the pool whose
   SLO fails) or shrunk until it is the smallest that meets the target attainment; then N+1 on every pool, so one
   failed replica (or a rolling upgrade) still leaves a deployment that meets the SLO at peak;
5. topology (failure domains, shared switches) is out of the simulator's scope and is printed as a reminder.
Cost = GPUs = replicas x tensor-parallel degree, summed over the pools (each pool may have its own degree). With a roofline cost model every step takes its lower-bound
time, so the plan is a LOWER bound on the hardware needed; with a calibrated model it is a prediction for the
profiled machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pdserve.engine.config import EngineConfig
from pdserve.sim.cluster import Cluster, ClusterSpec
from pdserve.sim.costmodel import StepShape
from pdserve.sim.workload import SLO


@dataclass
class PlanInput:
    rate: float
    slo: SLO
    workload: callable            # workload(rate, n, seed) -> list[RequestSpec]
    cost: object
    num_blocks: int
    engine: EngineConfig = field(default_factory=EngineConfig)
    tp: int = 1
    # a pool's own cost, blocks and TP (role -> cluster.PoolCost), e.g. prefill TP 1 and decode TP 4
    pools: dict = field(default_factory=dict)
    attainment: float = 0.9       # target SLO attainment
    peak_factor: float = 1.2      # headroom over the mean rate
    redundancy: int = 1           # N+1
    requests: int = 600           # requests per cluster check
    sweep_requests: int = 300     # requests per point of the per-replica sweep
    # every simulation's arrivals span at least this many TTFT SLOs (more requests at high rates): a run shorter
    # than a few SLOs ends before an overloaded queue pushes enough TTFTs past the SLO, and overstates capacity
    # (300 requests at 600 req/s arrive in 0.5 s; with a 1 s TTFT SLO a replica serving 200 req/s still met it
    # for 95% of them). 0: off (the planner's sweeps)
    min_span_ttfts: float = 0.0
    max_model_len: int | None = None
    modes: tuple = ("colocated", "disagg")
    seed: int = 0
    log: callable = None


def simulate(pi: PlanInput, spec: ClusterSpec, rate: float, n: int, slo: SLO) -> dict:
    """One cluster at one offered rate (`n` requests of `pi`'s workload, more where `min_span_ttfts` asks) -> the
    bench summary, SLO included."""
    if pi.min_span_ttfts and slo.ttft:  # only where TTFT is judged (a decode sweep judges TPOT)
        n = max(n, math.ceil(rate * pi.min_span_ttfts * slo.ttft))
    spec = replace(spec, num_blocks=pi.num_blocks, engine=pi.engine, max_model_len=pi.max_model_len, seed=pi.seed,
                   pools=pi.pools)
    c = Cluster(spec, pi.cost)
    c.run(pi.workload(rate, n, pi.seed))
    return c.summary(slo)


def _meets(s: dict, target: float) -> bool:
    return s["slo"]["attainment_ratio"] >= target


def replica_goodput(pi: PlanInput, spec: ClusterSpec, slo: SLO, cap: float = math.inf) -> tuple[float, float]:
    """Highest offered rate (req/s) at which `spec` meets `slo` with the target attainment, by doubling then
    bisection; returns (that rate, the goodput measured there)."""
    lo, hi, good = 0.0, None, 0.0
    r = max(pi.rate / 64, 0.05)
    for _ in range(24):  # doubling, up to `cap` (beyond it the other pool, not this replica, is the limit)
        if r > cap:
            hi = cap
            break
        s = simulate(pi, spec, r, pi.sweep_requests, slo)
        if _meets(s, pi.attainment):
            lo, good = r, s["slo"]["goodput_req_per_s"]
            r *= 2
        else:
            hi = r
            break
    if hi is None:
        return lo, good
    for _ in range(6):  # bisection to ~1.5%
        mid = (lo + hi) / 2
        s = simulate(pi, spec, mid, pi.sweep_requests, slo)
        if _meets(s, pi.attainment):
            lo, good = mid, s["slo"]["goodput_req_per_s"]
        else:
            hi = mid
    return lo, good


def _fail_side(s: dict, slo: SLO) -> str:
    """Which pool to grow: the one behind more of the requests that missed the SLO (TPOT, or a TTFT spent mostly
    waiting for the decode side's blocks, or turned away by admission for want of the decode pool's KV -> decode: a
    full decode pool queues or rejects requests instead of slowing its steps; the rest of TTFT -> prefill). Without per-request counts: by the p90s (TTFT -> prefill, TPOT -> decode), a
    decode-wait p90 over half the TTFT SLO -> decode."""
    misses = s.get("cluster", {}).get("slo_misses")
    if misses and any(misses.values()):  # the requests that missed, by the part that missed
        decode = misses["tpot"] + misses["ttft_decode_wait"] + misses.get("kv_capacity", 0)
        return "decode" if decode > misses["ttft_prefill"] else "prefill"
    lat = s["latency"]
    ttft_bad = slo.ttft is not None and lat["ttft_s"].get("p90", math.inf) > slo.ttft
    tpot_bad = slo.tpot is not None and lat["tpot_s"].get("p90", 0.0) > slo.tpot
    if tpot_bad and not ttft_bad:
        return "decode"
    if ttft_bad and s.get("cluster", {}).get("decode_wait_p90_s", 0.0) > slo.ttft / 2:
        return "decode"
    return "prefill"


def pool_rates(pi: PlanInput, cap: float = math.inf) -> tuple[float, float]:
    """Q19 step 1 for disaggregated pools: the highest rate (req/s) ONE prefill replica meets the TTFT SLO at (decode
    plentiful), and ONE decode replica the TPOT SLO (prefill plentiful). Also the planner's per-replica capacity
    (pdserve/planner/sizing.py), which passes `cap`: rates beyond it need not be told apart."""
    p_rate, _ = replica_goodput(pi, ClusterSpec(prefill=1, decode=4), SLO(ttft=pi.slo.ttft), cap=cap)
    # the decode replica is fed by a pool of 8 prefill replicas; rates beyond what that pool can prefill at all
    # measure the prefill pool, so the sweep stops there. What it can prefill is its *throughput*
    # (`prefill_throughput`), not its capacity under the TTFT SLO: a TTFT SLO one long prompt's prefill misses
    # (p_rate 0) made the decode capacity 0 too ("cannot meet the TPOT SLO at any rate", i.e. the decode pool's
    # maximum) and a tight one made it 8 x p_rate - for 735-token prompts with 7-token outputs 0.6 req/s where
    # the decode replica serves > 8: the decode count followed the prefill's TTFT, not the decode load
    feed = 8 * max(p_rate, prefill_throughput(pi))
    d_rate, _ = replica_goodput(pi, ClusterSpec(prefill=8, decode=1), SLO(tpot=pi.slo.tpot), cap=min(feed, cap))
    return p_rate, d_rate


def prefill_throughput(pi: PlanInput, n: int = 64) -> float:
    """Requests/s one prefill replica completes back to back (no queueing, no SLO) on `pi`'s workload lengths,
    from the cost model: each prompt alone, in chunks of the engine's token budget (batching several prompts in a
    step only shares the per-step cost: this is at most the replica's throughput). 0: no prompts."""
    pool = (pi.pools or {}).get("prefill")
    cost = getattr(pool, "cost", None) or pi.cost
    budget = max(1, pi.engine.max_num_batched_tokens if pi.engine.enable_chunked_prefill else 1 << 30)
    total, count = 0.0, 0
    for r in pi.workload(1.0, n, pi.seed):
        length, start = max(1, int(r.prompt_len)), 0
        while start < length:
            k = min(budget, length - start)
            pairs = k * start + k * (k + 1) // 2
            total += cost.step_time(StepShape(prefill_tokens=k, prefill_seqs=1, sum_context=start + k,
                                              attn_pairs=pairs, prefill_pairs=pairs,
                                              samples=1 if start + k == length else 0))
            start += k
        count += 1
    return count / total if total > 0 else 0.0


def plan(pi: PlanInput) -> dict:
    log = pi.log or (lambda *_: None)
    peak = pi.rate * pi.peak_factor
    slo = pi.slo
    result: dict = {"rate": pi.rate, "peak_rate": peak, "slo": slo.as_dict(), "attainment_target": pi.attainment,
                    "peak_factor": pi.peak_factor, "redundancy": pi.redundancy, "tp": pi.tp, "candidates": []}
    n = max(pi.requests, 1)

    if "colocated" in pi.modes:
        g_rate, g_good = replica_goodput(pi, ClusterSpec(colocated=1), slo)
        log(f"colocated: one replica meets the SLO up to {g_rate:.3g} req/s (goodput {g_good:.3g} req/s)")
        if g_rate > 0:
            c = max(1, math.ceil(peak / g_rate))
            c, s = _smallest(pi, lambda k: ClusterSpec(colocated=k), c, peak, n, log)
            final = ClusterSpec(colocated=c + pi.redundancy)
            result["candidates"].append(_candidate(pi, "colocated", final, s, {"per_replica_goodput_rate": g_rate},
                                                   peak, n))
    if "disagg" in pi.modes:
        p_rate, d_rate = pool_rates(pi)
        log(f"disagg: one prefill replica meets the TTFT SLO up to {p_rate:.3g} req/s, one decode replica the "
            f"TPOT SLO up to {d_rate:.3g} req/s")
        if p_rate > 0 and d_rate > 0:
            p, d = max(1, math.ceil(peak / p_rate)), max(1, math.ceil(peak / d_rate))
            (p, d), s = smallest_pd(pi, p, d, peak, n, log)
            final = ClusterSpec(prefill=p + pi.redundancy, decode=d + pi.redundancy)
            result["candidates"].append(_candidate(pi, "disagg", final, s, {"prefill_replica_rate": p_rate,
                                                                             "decode_replica_rate": d_rate},
                                                   peak, n))
    ok = [c for c in result["candidates"] if c["meets_slo_at_peak"]]
    if ok:
        result["best"] = min(ok, key=lambda c: (c["gpus"], -c["goodput_at_rate_req_per_s"]))
    result["topology_note"] = ("spread replicas of each pool over failure domains; the simulator assumes one flat "
                               "link for KV transfer and no shared-switch contention (Q19 step 5)")
    return result


def _smallest(pi, make, c, peak, n, log, limit=256):
    s = simulate(pi, make(c), peak, n, pi.slo)
    while not _meets(s, pi.attainment) and c < limit:
        c += max(1, c // 8)
        s = simulate(pi, make(c), peak, n, pi.slo)
    while c > 1:
        s2 = simulate(pi, make(c - 1), peak, n, pi.slo)
        if not _meets(s2, pi.attainment):
            break
        c, s = c - 1, s2
    log(f"  smallest colocated pool at peak: {c}")
    return c, s


def smallest_pd(pi, p, d, peak, n, log, limit=256):
    """Q19 step 4: from the lower bound (p, d), grow the pool whose SLO fails at `peak`, then shrink each pool
    while the target attainment holds; returns ((p, d), the summary at the result)."""
    s = simulate(pi, ClusterSpec(prefill=p, decode=d), peak, n, pi.slo)
    steps = 0
    while not _meets(s, pi.attainment) and p + d < limit and steps < 40:
        if _fail_side(s, pi.slo) == "decode":
            d += max(1, d // 8)
        else:
            p += max(1, p // 8)
        s = simulate(pi, ClusterSpec(prefill=p, decode=d), peak, n, pi.slo)
        steps += 1
    for side in ("prefill", "decode"):  # shrink each pool while the SLO still holds
        while (p if side == "prefill" else d) > 1:
            p2, d2 = (p - 1, d) if side == "prefill" else (p, d - 1)
            s2 = simulate(pi, ClusterSpec(prefill=p2, decode=d2), peak, n, pi.slo)
            if not _meets(s2, pi.attainment):
                break
            p, d, s = p2, d2, s2
    log(f"  smallest disaggregated pools at peak: {p}P+{d}D")
    return (p, d), s


def _candidate(pi, mode, spec, s_min, sweep, peak, n) -> dict:
    at_peak = simulate(pi, spec, peak, n, pi.slo)
    at_rate = simulate(pi, spec, pi.rate, n, pi.slo)
    tp = {role: pi.pools[role].tp if role in pi.pools else pi.tp for role in ("prefill", "decode", "both")}
    return {"mode": mode, "config": spec.label(), "prefill": spec.prefill, "decode": spec.decode,
            "colocated": spec.colocated, "replicas": spec.replicas,
            "gpus": spec.prefill * tp["prefill"] + spec.decode * tp["decode"] + spec.colocated * tp["both"],
            "tp": tp,
            "sweep": sweep, "without_redundancy_attainment_at_peak": s_min["slo"]["attainment_ratio"],
            "meets_slo_at_peak": _meets(at_peak, pi.attainment),
            "attainment_at_peak": at_peak["slo"]["attainment_ratio"],
            "goodput_at_peak_req_per_s": at_peak["slo"]["goodput_req_per_s"],
            "attainment_at_rate": at_rate["slo"]["attainment_ratio"],
            "goodput_at_rate_req_per_s": at_rate["slo"]["goodput_req_per_s"],
            "ttft_p90_s_at_peak": at_peak["latency"]["ttft_s"].get("p90"),
            "tpot_p90_s_at_peak": at_peak["latency"]["tpot_s"].get("p90")}


def format_plan(res: dict, cost_desc: dict) -> str:
    lines = [f"cost model: {cost_desc.get('kind')}"
             + (f" ({cost_desc.get('gpu')} x{cost_desc.get('tp')}, {cost_desc.get('model')})" if 'gpu' in cost_desc
                else "") + "".join(f"; {role} pool TP {d['tp']}" for role, d in cost_desc.get("pools", {}).items()),
             f"target: {res['rate']:g} req/s mean, checked at peak {res['peak_rate']:g} req/s "
             f"(x{res['peak_factor']:g}); SLO TTFT<={res['slo']['ttft_s']} s, TPOT<={res['slo']['tpot_s']} s, "
             f"attainment >= {res['attainment_target']:.0%}; N+{res['redundancy']} per pool",
             "", f"{'mode':10} {'config':12} {'GPUs':>5} {'attain@peak':>11} {'goodput@rate':>13} "
                 f"{'TTFT p90':>9} {'TPOT p90':>9}"]
    for c in res["candidates"]:
        lines.append(f"{c['mode']:10} {c['config']:12} {c['gpus']:5d} {c['attainment_at_peak']:11.3f} "
                     f"{c['goodput_at_rate_req_per_s']:10.3g} r/s {c['ttft_p90_s_at_peak'] or float('nan'):9.4f} "
                     f"{c['tpot_p90_s_at_peak'] or float('nan'):9.4f}")
    best = res.get("best")
    lines.append("")
    if best:
        lines.append(f"cheapest meeting the SLO: {best['mode']} {best['config']} on {best['gpus']} GPUs, predicted "
                     f"goodput {best['goodput_at_rate_req_per_s']:.3g} req/s at {res['rate']:g} req/s "
                     f"({best['attainment_at_rate']:.1%} attainment)")
    else:
        lines.append("no candidate meets the SLO (is the SLO below one request's unloaded latency?)")
    if "roofline" in str(cost_desc.get("kind")):
        lines.append("NOTE: roofline steps are lower bounds; this is the LEAST hardware that could meet the SLO.")
    lines.append("topology: " + res["topology_note"])
    return "\n".join(lines)
