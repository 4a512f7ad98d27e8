"""Exact metric math (spec §2.1, §2.2, §2.4). Pure functions over per-request records; no I/O.

System boundary (see docs/bench.md): the load generator's own clock (time.perf_counter).
  t_arrival  = the request's *scheduled* arrival time (open loop), so a stalled server cannot hide behind a
               late send (coordinated omission); in closed-loop mode the scheduled time is the actual send time,
               and results are labelled closed-loop.
  t_emit,j   = when the j-th content-bearing SSE chunk was read off the socket by the client.
Definitions:
  TTFT  = t_emit,1 - t_arrival
  ITL_j = t_emit,j - t_emit,j-1                  (j = 2..N_emit; one sample per chunk)
  TPOT  = (t_emit,last - t_emit,1) / (N_out - 1) only for N_out >= 2 (N_out = output tokens, from usage)
  E2E   = t_emit,last - t_arrival, so E2E = TTFT + sum(ITL) is an identity (no flush/close tail included).
Throughput is a rate over the window dt = [first scheduled arrival, last emit] of the measured requests,
labelled requests/s, output tokens/s or total (prompt + output) tokens/s. SLO attainment A = N_SLO / N_total
is a ratio; goodput G = N_SLO / dt is a rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence


@dataclass
class ClientRecord:
    """What the client observed for one request (times in seconds on one monotonic clock)."""
    idx: int
    scheduled: float             # t_arrival (scheduled); == sent in closed-loop mode
    sent: float | None = None    # when the request actually left the client
    emits: list[float] = field(default_factory=list)  # times of content-bearing chunks
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # N_out from usage; falls back to len(emits) when the server gives none
    ok: bool = False
    error: str | None = None
    tenant: int = 0
    warmup: bool = False
    stages: dict | None = None   # per-request server stage times when the server exposes them
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    path: str | None = None      # the server's `x-pdserve-path` header (which path served it, and why), if any

    @property
    def n_out(self) -> int:
        if self.output_tokens is not None:
            return self.output_tokens
        return len(self.emits)


def path_counts(records: Sequence[ClientRecord]) -> dict[str, int]:
    """Answered requests by the path their `x-pdserve-path` header named (`disagg`, `local`, `fallback`);
    `unlabelled`: answered without one."""
    out: dict[str, int] = {}
    for r in records:
        if r.ok:
            k = r.path.split(";", 1)[0].strip() if r.path else "unlabelled"
            out[k] = out.get(k, 0) + 1
    return out


def ttft(r: ClientRecord) -> float | None:
    return r.emits[0] - r.scheduled if r.emits else None


def itls(r: ClientRecord) -> list[float]:
    return [b - a for a, b in zip(r.emits, r.emits[1:])]


def tpot(r: ClientRecord) -> float | None:
    """(t_last - t_first) / (N_out - 1); undefined (None) for N_out < 2."""
    n = r.n_out
    if n < 2 or len(r.emits) < 1:
        return None
    return (r.emits[-1] - r.emits[0]) / (n - 1)


def e2e(r: ClientRecord) -> float | None:
    return r.emits[-1] - r.scheduled if r.emits else None


def send_lag(r: ClientRecord) -> float | None:
    return None if r.sent is None else r.sent - r.scheduled


def identity_residual(r: ClientRecord) -> float:
    """E2E - (TTFT + sum ITL): zero up to float rounding, by construction of the definitions."""
    if not r.emits:
        return 0.0
    return e2e(r) - (ttft(r) + sum(itls(r)))


# ---- SLO, throughput, goodput -------------------------------------------------------------------------------
@dataclass
class SLO:
    ttft: float | None = None   # seconds
    tpot: float | None = None   # seconds; vacuous for N_out < 2 (TPOT undefined)
    e2e: float | None = None

    def met(self, r: ClientRecord) -> bool:
        if not r.ok or not r.emits:
            return False
        if self.ttft is not None and ttft(r) > self.ttft:
            return False
        t = tpot(r)
        if self.tpot is not None and t is not None and t > self.tpot:
            return False
        if self.e2e is not None and e2e(r) > self.e2e:
            return False
        return True

    def as_dict(self) -> dict:
        return {"ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e}


def window(records: Sequence[ClientRecord]) -> float:
    """dt: first scheduled arrival -> last emit (or last scheduled arrival if nothing was emitted)."""
    if not records:
        return 0.0
    start = min(r.scheduled for r in records)
    ends = [r.emits[-1] for r in records if r.emits] + [r.scheduled for r in records]
    return max(ends) - start


def throughput(records: Sequence[ClientRecord], dt: float | None = None) -> dict:
    dt = window(records) if dt is None else dt
    done = [r for r in records if r.ok]
    out = sum(r.n_out for r in done)
    tot = out + sum(r.prompt_tokens or 0 for r in done)
    rate = (lambda x: x / dt) if dt > 0 else (lambda x: float("nan"))
    sched = sorted(r.scheduled for r in records)
    realized = (len(sched) - 1) / (sched[-1] - sched[0]) if len(sched) >= 2 and sched[-1] > sched[0] else float("nan")
    return {"window_s": dt, "realized_arrival_rate_req_per_s": realized,
            "request_throughput_req_per_s": rate(len(done)),
            "output_token_throughput_tok_per_s": rate(out),
            "total_token_throughput_tok_per_s": rate(tot),
            "completed": len(done)}


def slo_summary(records: Sequence[ClientRecord], slo: SLO, dt: float | None = None) -> dict:
    """Attainment (a ratio, dimensionless) and goodput (a rate) — different quantities, both reported."""
    dt = window(records) if dt is None else dt
    met = [r for r in records if slo.met(r)]
    n = len(records)
    return {"slo": slo.as_dict(),
            "n_total": n, "n_slo": len(met),
            "attainment_ratio": len(met) / n if n else float("nan"),
            "goodput_req_per_s": len(met) / dt if dt > 0 else float("nan"),
            "goodput_output_tok_per_s": sum(r.n_out for r in met) / dt if dt > 0 else float("nan")}


# ---- percentiles with distribution-free confidence intervals ------------------------------------------------
def percentile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default, 'type 7'); q in [0, 1]."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return float("nan")
    h = (n - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    return s[lo] + (h - lo) * (s[hi] - s[lo])


def _binom_cdfs(n: int, p: float) -> list[float]:
    """[P[Bin(n, p) <= k] for k = 0..n]: exact (log-space pmf) up to n = 200000, normal approximation beyond."""
    if n > 200000:
        mu, sd = n * p, math.sqrt(n * p * (1 - p))
        return [0.5 * (1 + math.erf((k + 0.5 - mu) / (sd * math.sqrt(2)))) for k in range(n + 1)]
    logp, log1p, lgn = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    out, total = [], 0.0
    for i in range(n + 1):
        total += math.exp(lgn - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * logp + (n - i) * log1p)
        out.append(min(1.0, total))
    return out


def quantile_ci(xs: Sequence[float], q: float, conf: float = 0.95) -> tuple[float | None, float | None]:
    """Order-statistic (binomial, distribution-free) CI for the q-quantile: [x_(l), x_(u)] (1-based ranks) with
    P[x_(l) > Q] <= a and P[x_(u) < Q] <= a, a = (1 - conf) / 2. A bound that would need an order statistic
    beyond the sample is None: the sample is too small to bound that side (e.g. p99's upper bound needs n >= 368)."""
    s = sorted(xs)
    n = len(s)
    if n == 0 or not 0 < q < 1:
        return None, None
    a = (1 - conf) / 2
    cdf = _binom_cdfs(n, q)
    # P[x_(l) > Q] = P[Bin(n,q) <= l-1]: the largest l with cdf[l-1] <= a
    lo = None
    for l in range(n, 0, -1):
        if cdf[l - 1] <= a:
            lo = s[l - 1]
            break
    # P[x_(u) < Q] = 1 - P[Bin(n,q) <= u-1]: the smallest u with cdf[u-1] >= 1-a
    hi = None
    for u in range(1, n + 1):
        if cdf[u - 1] >= 1 - a:
            hi = s[u - 1]
            break
    return lo, hi


QUANTILES = (0.5, 0.9, 0.99)


def describe(xs: Iterable[float], conf: float = 0.95) -> dict:
    xs = [x for x in xs if x is not None]
    d: dict = {"n": len(xs)}
    if not xs:
        return d
    d["mean"] = sum(xs) / len(xs)
    d["min"], d["max"] = min(xs), max(xs)
    for q in QUANTILES:
        key = f"p{round(q * 100)}"
        lo, hi = quantile_ci(xs, q, conf)
        d[key] = percentile(xs, q)
        d[key + "_ci"] = [lo, hi]
    d["ci_conf"] = conf
    return d


def latency_summary(records: Sequence[ClientRecord]) -> dict:
    ok = [r for r in records if r.ok and r.emits]
    return {"ttft_s": describe(ttft(r) for r in ok),
            "itl_s": describe(x for r in ok for x in itls(r)),
            "tpot_s": describe(tpot(r) for r in ok),
            "e2e_s": describe(e2e(r) for r in ok),
            "send_lag_s": describe(send_lag(r) for r in records),
            "tpot_undefined_n_out_lt_2": sum(1 for r in ok if r.n_out < 2),
            "tokens_per_chunk_mean": (sum(r.n_out for r in ok) / max(1, sum(len(r.emits) for r in ok)))
            if ok else None}


def summarize(records: Sequence[ClientRecord], slo: SLO) -> dict:
    """Everything for one load point: counts, latency distributions, labelled throughputs, SLO/goodput."""
    dt = window(records)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "unknown")[:80]
            errors[key] = errors.get(key, 0) + 1
    max_res = max((abs(identity_residual(r)) for r in records if r.ok), default=0.0)
    known = [r for r in records if r.ok and r.cached_tokens is not None and r.prompt_tokens]
    cached = (sum(r.cached_tokens for r in known) / sum(r.prompt_tokens for r in known)) if known else None
    return {"n_requests": len(records), "n_ok": sum(r.ok for r in records), "errors": errors,
            "latency": latency_summary(records), "throughput": throughput(records, dt),
            "slo": slo_summary(records, slo, dt), "identity_max_abs_residual_s": max_res,
            "prefix_cached_prompt_token_fraction": cached}
