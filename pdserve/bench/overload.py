"""Goodput under overload: capacity closed loop, then open loop at a multiple of it with a
per-request `timeout`, every request's outcome classified.

    python -m pdserve.bench.overload --base-url http://127.0.0.1:8000 --factor 3 --duration 60 --timeout 10

Goodput = requests answered in full (stream ended with [DONE]) within their deadline, per second of arrivals.
An outcome is judged at the client from the request's *scheduled* send time (no coordinated omission):
`ok` (complete, in time: from when the request left the client, as the server counts it), `late` (complete but past its deadline: must never happen, the workers cut a request
off at its deadline), `rejected` (429/503 answered at arrival), `left_queue` (503 `queue_deadline`: queued, then
its deadline became unreachable), `timed_out` (504, or a stream ended by `timed_out`), `error` (anything else).
Requests are the bench client's (`pdserve.bench.client`): streamed, exact output lengths (ignore_eos).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from pdserve.bench.client import LoadGen, Target
from pdserve.bench.metrics import ClientRecord
from pdserve.bench.workload import RequestSpec

OUTCOMES = ("ok", "late", "rejected", "left_queue", "timed_out", "error")


def _specs(n: int, rate: float | None, prompt_len: int, output_len: int, seed: int) -> list[RequestSpec]:
    """n requests with distinct id prompts (no prefix-cache hits between them); Poisson arrivals at `rate`."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        prompt = [rng.randrange(3, 250) for _ in range(prompt_len)]
        out.append(RequestSpec(idx=i, arrival=t, prompt=prompt, prompt_len=prompt_len, output_len=output_len))
        if rate:
            t += rng.expovariate(rate)
    return out


def classify(rec: ClientRecord, done: float | None, timeout_s: float, late_tolerance_s: float = 0.0) -> str:
    err = rec.error or ""
    code = re.search(r'"code":\s*"([^"]+)"', err)
    code = code.group(1) if code else ""
    if rec.ok:  # past its deadline as the server counts it (from when the request left this client)
        in_time = done is not None and done - (rec.sent or rec.scheduled) <= timeout_s + late_tolerance_s
        return "ok" if in_time else "late"
    if err.startswith(("HTTP 503", "HTTP 429")):
        return "left_queue" if code == "queue_deadline" else "rejected"
    if err.startswith("HTTP 504") or "timed_out" in err or "timeout" in code:
        return "timed_out"
    return "error"


def _q(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


@dataclass
class OverloadResult:
    capacity_rps: float
    offered_rps: float
    duration_s: float
    timeout_s: float
    counts: dict
    goodput_rps: float
    goodput_frac: float           # goodput / capacity
    ok_latency_s: dict            # from the scheduled send time
    reject_latency_s: dict        # at the client, scheduled send -> answer
    left_queue_latency_s: dict
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        c = self.counts
        return (f"capacity {self.capacity_rps:.2f} req/s, offered {self.offered_rps:.2f} req/s for "
                f"{self.duration_s:.0f} s (timeout {self.timeout_s:g} s): " +
                ", ".join(f"{k} {c.get(k, 0)}" for k in OUTCOMES) +
                f"; goodput {self.goodput_rps:.2f} req/s = {self.goodput_frac:.0%} of capacity; ok p50/max "
                f"{_fmt(self.ok_latency_s)}; rejected p50/p95/max {_fmt(self.reject_latency_s, 1000)}; left queue "
                f"p50/max {_fmt(self.left_queue_latency_s)}")


def _fmt(d: dict, scale: float = 1.0) -> str:
    unit = " ms" if scale == 1000 else " s"
    vals = [d.get(k) for k in ("p50", "p95", "max") if k in d]
    return "/".join(f"{v * scale:.0f}" if scale == 1000 else f"{v:.2f}" for v in vals if v is not None) + unit \
        if vals else "-"


def _dist(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": _q(xs, 0.5), "p95": _q(xs, 0.95), "max": max(xs) if xs else None}


async def capacity(target: Target, concurrency: int, n: int, prompt_len: int, output_len: int,
                   seed: int = 1) -> float:
    """Closed loop: completed requests / wall time with `concurrency` users (capacity, as the overload figures state it)."""
    gen = LoadGen(target)
    t0 = time.perf_counter()
    recs = await gen.run_closed(_specs(n, None, prompt_len, output_len, seed), concurrency)
    wall = time.perf_counter() - t0
    return sum(1 for r in recs if r.ok) / wall


async def overload(target: Target, rate: float, duration_s: float, timeout_s: float, prompt_len: int,
                   output_len: int, capacity_rps: float, seed: int = 2,
                   late_tolerance_s: float = 0.0) -> OverloadResult:
    """Open loop at `rate` for `duration_s`, each request with `timeout` = `timeout_s` in its body.
    `late_tolerance_s`: how much past its timeout (from sending) a complete answer still counts as `ok`: the
    server's deadline starts when the gateway reads the request, which on a starved host is later."""
    done: dict[int, float] = {}
    target.extra_body = {**target.extra_body, "timeout": timeout_s}
    target.timeout_s = max(target.timeout_s, timeout_s + 30)
    gen = LoadGen(target, on_done=lambda r: done.__setitem__(r.idx, time.perf_counter()))
    n = max(1, int(rate * duration_s))
    recs = await gen.run_open(_specs(n, rate, prompt_len, output_len, seed), drain_timeout_s=timeout_s + 30)
    outcome = {r.idx: classify(r, done.get(r.idx), timeout_s, late_tolerance_s) for r in recs}
    counts = Counter(outcome.values())
    lat = {k: [done[r.idx] - r.scheduled for r in recs if outcome[r.idx] == k and r.idx in done] for k in OUTCOMES}
    span = max(duration_s, max((s for s in (r.scheduled - gen.t0 for r in recs)), default=0.0))
    good = counts["ok"] / span
    errs = sorted({(r.error or "")[:160] for r in recs if outcome[r.idx] == "error"})[:5]
    return OverloadResult(capacity_rps, rate, span, timeout_s, dict(counts), good, good / capacity_rps,
                          _dist(lat["ok"]), _dist(lat["rejected"]), _dist(lat["left_queue"]), errs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.overload", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--factor", type=float, default=3.0, help="offered rate = factor x measured capacity")
    p.add_argument("--duration", type=float, default=60.0, help="s of open-loop arrivals")
    p.add_argument("--timeout", type=float, default=10.0, help="per-request timeout (body `timeout`), s")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop users for the capacity measure")
    p.add_argument("--capacity-requests", type=int, default=60)
    p.add_argument("--capacity", type=float, default=None, help="skip the measure: req/s")
    p.add_argument("--json", default=None, help="write the result here")
    a = p.parse_args(argv)

    async def run() -> OverloadResult:
        cap = a.capacity or await capacity(Target(a.base_url), a.concurrency, a.capacity_requests, a.prompt_len,
                                           a.output_len)
        print(f"capacity {cap:.2f} req/s (closed loop, {a.concurrency} users)", flush=True)
        return await overload(Target(a.base_url), a.factor * cap, a.duration, a.timeout, a.prompt_len,
                              a.output_len, cap)

    res = asyncio.run(run())
    print(res.line())
    for e in res.errors:
        print("  error:", e)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(asdict(res), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
