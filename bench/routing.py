"""Routing benchmark: cache-aware (the real Policy) vs round-robin vs least-loaded on a prefix-heavy workload,
side by side in one run: mean / p99 TTFT, goodput under an SLO, prefix hit ratio, per-worker load.

    python bench/routing.py [--workers 4] [--rate 25] [--n 800] [--seeds 1,2,3] [--ttft-slo 0.5]

Router-level: the workers are simulated (pdserve/services/router/sim.py: FIFO prefill at a fixed rate, batched
decode, LRU prefix caches of real chained block hashes), the router code, the prefix index and its Redis mirror
are the real ones. It needs a Redis (default redis://127.0.0.1:6379/0). It measures routing quality, not the
engine: numbers on a real pool also depend on the engine's speed, which the simulator takes as a parameter.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis.asyncio as aioredis  # noqa: E402

from pdserve.services.router.policy import Policy  # noqa: E402
from pdserve.services.router.sim import LeastLoaded, Oracle, RoundRobin, Sim, WorkerSpec, Workload  # noqa: E402


async def run_one(name: str, wl: Workload, workers: int, redis_url: str, seed: int):
    r = aioredis.from_url(redis_url)
    ref: list = []
    pol = {"cache-aware": lambda: Policy("auto", rng=random.Random(seed)), "round-robin": RoundRobin,
           "least-loaded": lambda: LeastLoaded(random.Random(seed)), "oracle-affinity": lambda: Oracle(ref)}[name]()
    sim = Sim({f"w{i}": WorkerSpec() for i in range(workers)}, pol, r)
    ref.append(sim)
    try:
        return await sim.run(wl.generate())
    finally:
        async for k in r.scan_iter(f"pdserve:{sim.model}:*"):
            await r.delete(k)
        await r.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=25.0, help="requests/s (Poisson)")
    ap.add_argument("--n", type=int, default=800)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--ttft-slo", type=float, default=0.5)
    ap.add_argument("--tpot-slo", type=float, default=0.05)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    a = ap.parse_args()
    names = ["cache-aware", "round-robin", "least-loaded", "oracle-affinity"]
    rows: dict[str, list] = {n: [] for n in names}
    for seed in [int(s) for s in a.seeds.split(",")]:
        wl = Workload(rate=a.rate, n=a.n, seed=seed)
        for n in names:
            res = asyncio.run(run_one(n, wl, a.workers, a.redis_url, seed))
            served = res.served()
            rows[n].append((res.mean_ttft, res.pct(0.99), res.goodput(a.ttft_slo, a.tpot_slo), res.hit_ratio,
                            max(served.values()) / max(1, min(served.values()))))
    print(f"{a.workers} colocated workers, {a.rate:g} req/s, {a.n} requests x seeds {a.seeds}; "
          f"SLO: TTFT <= {a.ttft_slo}s and TPOT <= {a.tpot_slo}s (means over seeds)")
    print(f"{'policy':<16}{'mean TTFT':>11}{'p99 TTFT':>10}{'goodput/s':>11}{'hit ratio':>11}{'max/min load':>14}")
    for n in names:
        m = [statistics.mean(c) for c in zip(*rows[n])]
        print(f"{n:<16}{m[0]:>10.3f}s{m[1]:>9.3f}s{m[2]:>11.2f}{m[3]:>11.3f}{m[4]:>14.2f}")
    base = max(statistics.mean(r[2] for r in rows[n]) for n in ("round-robin", "least-loaded"))
    ours = statistics.mean(r[2] for r in rows["cache-aware"])
    print(f"cache-aware goodput vs the better baseline: {100 * (ours / base - 1):+.0f}% (target >= +20%)")


if __name__ == "__main__":
    main()
