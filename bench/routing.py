"""Routing benchmark: cache-aware (the real Policy) vs round-robin vs least-loaded vs an oracle on a prefix-heavy
workload, side by side in one run: mean / p99 TTFT, goodput under an SLO, prefix hit ratio, per-worker load.

    python bench/routing.py [--workers 4] [--rate 25] [--n 800] [--seeds 1,2,3] [--ttft-slo 0.5] [--quick]
                            [--index direct|redis]

Router-level, on the one simulator (`pdserve.sim`): each replica is the engine's own scheduler, block manager
and step bookkeeping stepped by a linear cost model (4000 prompt tokens/s, 10 ms + 0.4 ms per sequence per
decode step, 600 KV blocks of 16 tokens); the router's Policy, cost model and prefix index are the real ones,
the index fed through Redis with `--index redis` (default redis://127.0.0.1:6379/0). The baselines are
`RouterSpec.policy` options. It measures routing quality, not the engine: numbers on a real pool also depend
on the engine's speed, which the simulator takes as a parameter (`pdserve sim profile` measures it).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.sim.chats import ChatWorkload  # noqa: E402
from pdserve.sim.cluster import Cluster, ClusterSpec  # noqa: E402
from pdserve.sim.costmodel import LinearCostModel  # noqa: E402
from pdserve.sim.placer import RouterSpec  # noqa: E402
from pdserve.sim.workload import SLO  # noqa: E402

NAMES = {"cache-aware": "cache-aware", "round-robin": "round-robin", "least-loaded": "least-loaded",
         "oracle-affinity": "oracle"}
COST = LinearCostModel(a=0.01, b=1 / 4000, c=0.0004, kv_bytes_per_token=2 * 1024 * 1024 / 16,
                       link_bytes_per_s=5e9, handoff_s=0.002)


def run_one(policy: str, wl: ChatWorkload, workers: int, index: str, redis_url: str, slo: SLO) -> tuple:
    spec = ClusterSpec(colocated=workers, num_blocks=600, report_s=0.5, seed=wl.seed, admission=None,
                       router=RouterSpec(policy=policy, index=index if policy == "cache-aware" else "direct",
                                         redis_url=redis_url))
    c = Cluster(spec, COST)
    try:
        c.run(wl.generate())
        s = c.summary(slo)
    finally:
        c.close()
    served = [r.placed for r in c.replicas]
    ttft = s["latency"]["ttft_s"]
    return (ttft["mean"], ttft["p99"], s["slo"]["goodput_req_per_s"], c.prefix_hit_ratio(),
            max(served) / max(1, min(served)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=25.0, help="requests/s (Poisson)")
    ap.add_argument("--n", type=int, default=800)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--ttft-slo", type=float, default=0.5)
    ap.add_argument("--tpot-slo", type=float, default=0.05)
    ap.add_argument("--index", choices=("direct", "redis"), default="redis",
                    help="how the cache-aware router's prefix index follows the replicas' block events")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--quick", action="store_true", help="200 requests, one seed (a smoke run, seconds)")
    a = ap.parse_args()
    if a.quick:
        a.n, a.seeds = 200, a.seeds.split(",")[0]
    slo = SLO(ttft=a.ttft_slo, tpot=a.tpot_slo)
    rows: dict[str, list] = {n: [] for n in NAMES}
    for seed in [int(s) for s in a.seeds.split(",")]:
        wl = ChatWorkload(rate=a.rate, n=a.n, seed=seed)
        for name, policy in NAMES.items():
            rows[name].append(run_one(policy, wl, a.workers, a.index, a.redis_url, slo))
    print(f"{a.workers} colocated workers, {a.rate:g} req/s, {a.n} requests x seeds {a.seeds}; "
          f"SLO: TTFT <= {a.ttft_slo}s and TPOT <= {a.tpot_slo}s (means over seeds)")
    print(f"{'policy':<16}{'mean TTFT':>11}{'p99 TTFT':>10}{'goodput/s':>11}{'hit ratio':>11}{'max/min load':>14}")
    for n in NAMES:
        m = [statistics.mean(c) for c in zip(*rows[n])]
        print(f"{n:<16}{m[0]:>10.3f}s{m[1]:>9.3f}s{m[2]:>11.2f}{m[3]:>11.3f}{m[4]:>14.2f}")
    base = max(statistics.mean(r[2] for r in rows[n]) for n in ("round-robin", "least-loaded"))
    ours = statistics.mean(r[2] for r in rows["cache-aware"])
    print(f"cache-aware goodput vs the better baseline: {100 * (ours / base - 1):+.0f}% (target >= +20%)")


if __name__ == "__main__":
    main()
