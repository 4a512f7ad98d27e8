"""The simulator's prediction of every break-even cell, and its error against the measurement.

Per mode the deployment is rebuilt in `pdserve sim` (the engine's own scheduler and the router's own policy, with
the calibrated step-time model profiled on this machine just before the runs, `pdserve sim profile`):

  colocated 1x2: one `both` replica, steps priced by a 2-thread profile; 2x1: two `both` replicas, 1 thread
  disagg[@LINK]: 1 prefill + 1 decode replica, the router in `disagg` mode, 1 thread
  auto[@LINK]:   the same pools, the router in `auto` mode (a decode replica may prefill a request itself)

The link is the KV hand-off's cost: `handoff_s + bytes / (rate / 8)` per pull, plus one round trip (2 x delay)
where the link has a delay. Without a link (one host) the profile's in-machine copy bandwidth stands in.

What the profile cannot see is priced on each deployment from its own isolated requests (measured before its
cells, alone): the served decode step's overhead over the profiled one (`validate_up.served`: the worker's event
loop and gRPC stream per step) = isolated TPOT minus the simulated one, median over the (prompt, output)
pairs. The HTTP / router front-end is not simulated (docs/sim.md): it shows up as error, and the report says so.
"""
from __future__ import annotations

import dataclasses
import statistics

from pdserve.engine.config import EngineConfig
from pdserve.sim.cluster import ClusterSpec, simulate
from pdserve.sim.costmodel import LinearCostModel
from pdserve.sim.placer import RouterSpec
from pdserve.sim.validate_up import served

CPU_KV_POOL_BYTES = 256 << 20  # engine/config.py: the KV pool on CPU without --num-gpu-blocks


@dataclasses.dataclass(frozen=True)
class SimLayout:
    pools: dict
    router_mode: str
    threads: int  # torch threads per worker: which profile prices its steps


def layout(mode: str, colocated_layout: str = "1x2") -> SimLayout:
    """The simulated counterpart of a break-even mode ("colocated", "disagg", "auto", "disagg@10gbit", ...)."""
    base = mode.split("@", 1)[0]
    if base == "colocated":
        return SimLayout({"colocated": 2}, "colocated", 1) if colocated_layout == "2x1" \
            else SimLayout({"colocated": 1}, "colocated", 2)
    if base in ("disagg", "auto"):
        return SimLayout({"prefill": 1, "decode": 1}, base, 1)
    raise ValueError(f"no simulated layout for mode {mode!r}")


def link_of(mode: str) -> str | None:
    return mode.split("@", 1)[1] if "@" in mode else None


def link_cost(cost: LinearCostModel, link: str | None) -> LinearCostModel:
    """The cost model with the KV link's rate (bit/s -> bytes/s) and one round trip of its delay in the hand-off."""
    if not link:
        return cost
    from pdserve.lab.netns import Link
    L = Link.parse(link)
    return dataclasses.replace(cost, link_bytes_per_s=L.rate_bps / 8 if L.rate_bps else cost.link_bytes_per_s,
                               handoff_s=cost.handoff_s + 2 * L.delay_ms / 1e3,
                               meta={**cost.meta, "link": link})


def num_blocks(cost: LinearCostModel, num_gpu_blocks: int | None, block_size: int = 16) -> int:
    """The deployment's KV blocks per worker: as given, else what the engine sizes on CPU (256 MiB)."""
    if num_gpu_blocks:
        return num_gpu_blocks
    per_block = cost.kv_bytes_per_token * block_size
    return int(CPU_KV_POOL_BYTES // per_block) if per_block > 0 else 4096


def run(cost, specs, lay: SimLayout, slo, blocks: int, max_num_seqs: int) -> dict:
    spec = ClusterSpec(**lay.pools, num_blocks=blocks, engine=EngineConfig(max_num_seqs=max_num_seqs),
                       router=RouterSpec(mode=lay.router_mode))
    return simulate(spec, cost, specs, slo, vocab_size=4096)


def step_overhead(cost, isolated: dict, lone_specs, lay: SimLayout, slo, blocks: int, max_num_seqs: int) -> float:
    """Seconds a served decode step costs beyond the profiled one on this deployment: per isolated (P x O) entry
    its measured TPOT minus the simulated lone request's, the median, >= 0. `lone_specs(P, O)` -> the one-request
    workload. TPOT, not the ITL p50: on a loaded 2-core box a stream's chunks can arrive in bursts, and half the
    gaps of one request were then ~10 us (an ITL p50 of 12 us against a TPOT of ms); results from before the
    isolated TPOT was recorded fall back to the ITL p50."""
    gaps = []
    for key, iso in isolated.items():
        itl = iso.get("tpot_s", iso.get("itl_p50_s"))
        if itl is None:
            continue
        plen, olen = (int(x) for x in key.split("x"))
        sim = run(cost, lone_specs(plen, olen), lay, slo, blocks, max_num_seqs)["latency"]["tpot_s"].get("p50")
        if sim is not None:
            gaps.append(itl - sim)
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


def rel_err(pred: float | None, meas: float | None) -> float | None:
    """(predicted - measured) / measured; None where either is missing or the measurement is 0."""
    if pred is None or meas is None or meas == 0:
        return None
    return (pred - meas) / meas


PREDICTED = (("goodput_req_per_s", ("slo", "goodput_req_per_s")),
             ("attainment_ratio", ("slo", "attainment_ratio")),
             ("ttft_p50_s", ("latency", "ttft_s", "p50")),
             ("tpot_p50_s", ("latency", "tpot_s", "p50")))


def _dig(d: dict, path: tuple):
    for k in path:
        d = (d or {}).get(k)
    return d


def cell_prediction(sim_summary: dict, measured: dict) -> dict:
    """Predicted, measured and relative error of each predicted quantity; attainment's error is the difference
    (a ratio of ratios near 0 says nothing)."""
    out = {}
    for name, path in PREDICTED:
        p, m = _dig(sim_summary, path), measured.get(name)
        out[name] = {"predicted": p, "measured": m,
                     "error": (None if p is None or m is None else p - m) if name == "attainment_ratio"
                     else rel_err(p, m)}
    out["kv_transfer_mean_s"] = {"predicted": (sim_summary.get("cluster") or {}).get("mean_transfer_s"),
                                 "measured": measured.get("kv_transfer_mean_s")}
    return out


def predict_mode(costs: dict[int, LinearCostModel], mode: str, res: dict, grid, make_specs, slo, *,
                 colocated_layout: str, num_gpu_blocks: int | None, max_num_seqs: int) -> dict:
    """Fills res["cells"][k]["sim"] for every measured cell of `mode`; returns the prediction's settings.
    `make_specs(plen, olen, rate, cell_index)` -> the cell's seeded workload, as measured."""
    lay = layout(mode, colocated_layout)
    cost = link_cost(costs[lay.threads], link_of(mode))
    blocks = num_blocks(cost, num_gpu_blocks)
    lone = lambda p, o: make_specs(p, o, 0.0, None)[:1]  # noqa: E731 - one request: the isolated ones ran alone
    over = step_overhead(cost, res.get("isolated", {}), lone, lay, slo, blocks, max_num_seqs)
    mcost = served(cost, over)
    for ci, (plen, olen, rate) in enumerate(grid):
        row = res.get("cells", {}).get(f"{plen}x{olen}x{rate:g}")
        if row is None:
            continue
        sim = run(mcost, make_specs(plen, olen, rate, ci), lay, slo, blocks, max_num_seqs)
        row["sim"] = cell_prediction(sim, row)
    info = {"pools": lay.pools, "router_mode": lay.router_mode, "threads": lay.threads, "num_blocks": blocks,
            "link_bytes_per_s": cost.link_bytes_per_s, "handoff_s": cost.handoff_s,
            "served_step_overhead_s": over}
    res["sim"] = info
    return info


def threads_needed(modes: list[str], colocated_layout: str) -> set[int]:
    return {layout(m, colocated_layout).threads for m in modes}


def costs(model: str, threads: set[int], out_dir, reuse_dir: str | None = None, log=None) -> dict[int, LinearCostModel]:
    """The calibrated cost model per torch thread count: `costs_tN.json` from `reuse_dir`, else profiled now on
    this machine (before any deployment starts, so nothing else of ours competes) and saved into `out_dir`."""
    from pathlib import Path

    from pdserve.sim.costmodel import load_cost_model, profile
    got = {}
    for n in sorted(threads):
        src = Path(reuse_dir) / f"costs_t{n}.json" if reuse_dir else None
        if src is not None and src.exists():
            got[n] = load_cost_model(src)
        else:
            got[n] = profile(model, threads=n)
        got[n].save(Path(out_dir) / f"costs_t{n}.json")
        if log:
            log(f"sim: cost model for {n} thread(s): a={got[n].a * 1e3:.2f} ms, b={got[n].b * 1e6:.1f} us/token, "
                f"median fit error {got[n].meta.get('median_rel_err', float('nan')):.1%}")
    return got
