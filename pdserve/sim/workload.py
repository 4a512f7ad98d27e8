"""Narrow seam to `pdserve bench`'s workload specs, trace reader and metric math.

The simulator takes a list of requests with `arrival`, `prompt` (token ids), `prompt_len`, `output_len` -
`pdserve.bench.workload.RequestSpec` - and reports through `pdserve.bench.metrics` (`RequestRecord`, `SLO`,
`summarize`). When the bench package is importable those are used as they are (one implementation). Until it
lands on main, the fallbacks below keep the same names and fields, restricted to what the sim needs: Poisson
arrivals, fixed/uniform lengths, JSONL traces with timestamp/prompt_len/output_len, and the spec §2.1/§2.2
definitions. Delete the fallbacks once bench is on main.
"""
from __future__ import annotations

try:  # pragma: no cover - depends on whether the bench branch has landed
    from pdserve.bench.metrics import SLO, RequestRecord, summarize  # noqa: F401
    from pdserve.bench.workload import LengthDist, RequestSpec, load_trace, synthetic  # noqa: F401
    BENCH = True
except ImportError:  # ---- fallback until pdserve.bench is on main ----------------------------------------------
    BENCH = False
    import json
    import math
    import random
    from dataclasses import dataclass, field
    from pathlib import Path

    @dataclass
    class RequestSpec:
        idx: int
        arrival: float
        prompt: list
        prompt_len: int
        output_len: int
        tenant: int = 0
        messages: list | None = None

    @dataclass
    class LengthDist:
        kind: str
        a: float = 0
        b: float = 0
        cap: int | None = None

        @classmethod
        def parse(cls, s) -> "LengthDist":
            if isinstance(s, int) or str(s).isdigit():
                return cls("fixed", int(s))
            kind, *nums = str(s).split(":")
            if kind == "fixed" and len(nums) == 1:
                return cls("fixed", float(nums[0]))
            if kind == "uniform" and len(nums) == 2:
                return cls("uniform", float(nums[0]), float(nums[1]))
            raise ValueError(f"bad length distribution {s!r}: fixed:N | uniform:LO:HI")

        def sample(self, rng: random.Random) -> int:
            v = self.a if self.kind == "fixed" else rng.randint(int(self.a), int(self.b))
            return max(1, int(round(v)))

    def synthetic(n: int, rate: float, prompt_len: LengthDist, output_len: LengthDist, *, seed: int = 0,
                  process: str = "poisson", **_) -> list[RequestSpec]:
        rng, arr = random.Random(seed), random.Random(seed + 1)
        t, out = 0.0, []
        for i in range(n):
            if i:
                t += arr.expovariate(rate) if process == "poisson" else 1.0 / rate
            plen = prompt_len.sample(rng)
            out.append(RequestSpec(i, t, [rng.randrange(3, 250) for _ in range(plen)], plen,
                                   output_len.sample(rng)))
        return out

    def load_trace(path, *, n: int | None = None, rate: float | None = None, seed: int = 0,
                   time_scale: float = 1.0, default_output_len: int = 64, **_) -> list[RequestSpec]:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        rng, specs = random.Random(seed), []
        for row in rows[:n]:
            prompt = row.get("prompt")
            plen = len(prompt) if isinstance(prompt, list) else int(row.get("prompt_len", row.get("input_len", 0)))
            if plen <= 0:
                continue
            prompt = prompt if isinstance(prompt, list) else [rng.randrange(3, 250) for _ in range(plen)]
            ts = row.get("timestamp", row.get("arrival"))
            specs.append(RequestSpec(len(specs), float(ts) * time_scale if ts is not None else -1.0, prompt, plen,
                                     int(row.get("output_len", default_output_len))))
        if rate is not None or any(s.arrival < 0 for s in specs):
            arr, t = random.Random(seed + 1), 0.0
            for i, s in enumerate(specs):
                t += arr.expovariate(rate or 1.0) if i else 0.0
                s.arrival = t
        else:
            t0 = min((s.arrival for s in specs), default=0.0)
            for s in specs:
                s.arrival -= t0
            specs.sort(key=lambda s: s.arrival)
        return specs

    @dataclass
    class RequestRecord:
        idx: int
        scheduled: float
        sent: float | None = None
        emits: list = field(default_factory=list)
        prompt_tokens: int | None = None
        output_tokens: int | None = None
        ok: bool = False
        error: str | None = None
        tenant: int = 0
        warmup: bool = False
        stages: dict | None = None
        cached_tokens: int | None = None

        @property
        def n_out(self) -> int:
            return self.output_tokens if self.output_tokens is not None else len(self.emits)

    def _ttft(r):
        return r.emits[0] - r.scheduled if r.emits else None

    def _tpot(r):
        return (r.emits[-1] - r.emits[0]) / (r.n_out - 1) if r.n_out >= 2 and r.emits else None

    def _e2e(r):
        return r.emits[-1] - r.scheduled if r.emits else None

    @dataclass
    class SLO:
        ttft: float | None = None
        tpot: float | None = None
        e2e: float | None = None

        def met(self, r) -> bool:
            if not r.ok or not r.emits:
                return False
            if self.ttft is not None and _ttft(r) > self.ttft:
                return False
            t = _tpot(r)
            if self.tpot is not None and t is not None and t > self.tpot:
                return False
            return not (self.e2e is not None and _e2e(r) > self.e2e)

        def as_dict(self) -> dict:
            return {"ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e}

    def _pct(xs, q):
        s = sorted(xs)
        if not s:
            return float("nan")
        h = (len(s) - 1) * q
        lo = math.floor(h)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (h - lo) * (s[hi] - s[lo])

    def _describe(xs) -> dict:
        xs = [x for x in xs if x is not None]
        d = {"n": len(xs)}
        if xs:
            d.update(mean=sum(xs) / len(xs), min=min(xs), max=max(xs),
                     p50=_pct(xs, .5), p90=_pct(xs, .9), p99=_pct(xs, .99))
        return d

    def summarize(records, slo) -> dict:
        start = min((r.scheduled for r in records), default=0.0)
        dt = max([r.emits[-1] for r in records if r.emits] + [r.scheduled for r in records], default=0.0) - start
        ok = [r for r in records if r.ok and r.emits]
        met = [r for r in records if slo.met(r)]
        out_tok = sum(r.n_out for r in ok)
        rate = (lambda x: x / dt) if dt > 0 else (lambda x: float("nan"))
        return {"n_requests": len(records), "n_ok": len(ok),
                "latency": {"ttft_s": _describe(_ttft(r) for r in ok),
                            "itl_s": _describe(b - a for r in ok for a, b in zip(r.emits, r.emits[1:])),
                            "tpot_s": _describe(_tpot(r) for r in ok), "e2e_s": _describe(_e2e(r) for r in ok),
                            "tpot_undefined_n_out_lt_2": sum(1 for r in ok if r.n_out < 2)},
                "throughput": {"window_s": dt, "request_throughput_req_per_s": rate(len(ok)),
                               "output_token_throughput_tok_per_s": rate(out_tok),
                               "total_token_throughput_tok_per_s": rate(out_tok + sum(r.prompt_tokens or 0
                                                                                     for r in ok)),
                               "completed": len(ok)},
                "slo": {"slo": slo.as_dict(), "n_total": len(records), "n_slo": len(met),
                        "attainment_ratio": len(met) / len(records) if records else float("nan"),
                        "goodput_req_per_s": rate(len(met)),
                        "goodput_output_tok_per_s": rate(sum(r.n_out for r in met))}}


def make_workload(n: int, rate: float, prompt_len, output_len, seed: int = 0, process: str = "poisson",
                  vocab: int | None = None) -> list:
    """Synthetic open-loop workload with token-id prompts (what the simulator consumes)."""
    specs = synthetic(n, rate, LengthDist.parse(prompt_len), LengthDist.parse(output_len), seed=seed,
                      process=process)
    return specs
