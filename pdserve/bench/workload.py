"""Workloads: a seeded schedule of requests (arrival offsets, prompts, output lengths, tenants).

Arrivals: open-loop Poisson (exponential gaps) or gamma (CV knob; CV = 1 is Poisson, CV > 1 is bursty), or
the trace's own timestamps. Lengths: `fixed:N`, `uniform:LO:HI`, `lognormal:MEDIAN:SIGMA[:MAX]`.
Traces: JSONL (or a JSON array) of objects with any of `timestamp` (s), `prompt` (text), `prompt_len`,
`output_len`; ShareGPT-style `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`
(first human turn = prompt, the following gpt turn's length = output length).
Prompts are token-id lists (exact lengths; accepted by pdserve and vLLM-style `/v1/completions`) or text.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly vexing sphinx "
         "of black quartz judge my vow and pack my box with five dozen liquor jugs").split()


@dataclass
class RequestSpec:
    idx: int
    arrival: float                    # scheduled offset from the start of the run, seconds
    prompt: list[int] | str
    prompt_len: int                   # tokens for id prompts; words (an estimate) for text prompts
    output_len: int
    tenant: int = 0
    messages: list[dict] | None = None  # chat endpoint


@dataclass
class LengthDist:
    kind: str
    a: float = 0
    b: float = 0
    cap: int | None = None

    @classmethod
    def parse(cls, s: str | int) -> "LengthDist":
        if isinstance(s, int) or str(s).isdigit():
            return cls("fixed", int(s))
        parts = str(s).split(":")
        kind = parts[0]
        nums = [float(x) for x in parts[1:]]
        if kind == "fixed" and len(nums) == 1:
            return cls("fixed", nums[0])
        if kind == "uniform" and len(nums) == 2:
            return cls("uniform", nums[0], nums[1])
        if kind == "lognormal" and len(nums) in (2, 3):
            return cls("lognormal", nums[0], nums[1], int(nums[2]) if len(nums) == 3 else None)
        raise ValueError(f"bad length distribution {s!r}: fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:MAX]")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            v = self.a
        elif self.kind == "uniform":
            v = rng.randint(int(self.a), int(self.b))
        else:
            v = rng.lognormvariate(math.log(self.a), self.b)
        v = max(1, int(round(v)))
        return min(v, self.cap) if self.cap else v

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"lognormal:{self.a:g}:{self.b:g}" + (f":{self.cap}" if self.cap else "")


def arrivals(n: int, rate: float, rng: random.Random, process: str = "poisson", cv: float = 1.0) -> list[float]:
    """n scheduled arrival offsets (first at 0) with mean rate `rate` req/s. gamma: shape k = 1/CV^2,
    scale = 1/(rate k), so the mean gap stays 1/rate and CV sets the burstiness. constant: evenly spaced."""
    if n <= 0:
        return []
    if rate <= 0 or math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, [0.0]
    for _ in range(n - 1):
        if process == "poisson":
            gap = rng.expovariate(rate)
        elif process == "gamma":
            k = 1.0 / (cv * cv)
            gap = rng.gammavariate(k, 1.0 / (rate * k))
        elif process == "constant":
            gap = 1.0 / rate
        else:
            raise ValueError(f"unknown arrival process {process!r} (poisson, gamma, constant)")
        t += gap
        out.append(t)
    return out


@dataclass
class PromptMaker:
    """Token-id prompts (exact lengths) or word prompts; optional shared prefixes per tenant."""
    fmt: str = "ids"                 # ids | text
    token_range: tuple[int, int] = (3, 250)  # ids drawn from [lo, hi): stay inside a small vocab
    shared_prefix_len: int = 0
    shared_prefix_frac: float = 0.0  # fraction of requests that start with their tenant's shared prefix
    tenants: int = 1
    _prefixes: dict = field(default_factory=dict)

    def _tokens(self, n: int, rng: random.Random) -> list:
        if self.fmt == "ids":
            return [rng.randrange(*self.token_range) for _ in range(n)]
        return [rng.choice(WORDS) for _ in range(n)]

    def prefix(self, tenant: int, seed: int) -> list:
        if tenant not in self._prefixes:
            self._prefixes[tenant] = self._tokens(self.shared_prefix_len, random.Random(seed * 7919 + tenant))
        return self._prefixes[tenant]

    def make(self, n: int, tenant: int, rng: random.Random, seed: int) -> tuple[list[int] | str, int]:
        toks: list = []
        if self.shared_prefix_len and rng.random() < self.shared_prefix_frac:
            toks = list(self.prefix(tenant, seed)[:max(0, n - 1)])
        toks += self._tokens(n - len(toks), rng)
        if self.fmt == "ids":
            return toks, n
        return " ".join(toks), n


def synthetic(n: int, rate: float, prompt_len: LengthDist, output_len: LengthDist, *, seed: int = 0,
              process: str = "poisson", cv: float = 1.0, maker: PromptMaker | None = None,
              chat: bool = False) -> list[RequestSpec]:
    rng = random.Random(seed)
    maker = maker or PromptMaker()
    times = arrivals(n, rate, random.Random(seed + 1), process, cv)
    specs = []
    for i, t in enumerate(times):
        tenant = i % max(1, maker.tenants)
        plen = prompt_len.sample(rng)
        olen = output_len.sample(rng)
        prompt, plen = maker.make(plen, tenant, rng, seed)
        msgs = None
        if chat:
            text = prompt if isinstance(prompt, str) else " ".join(WORDS[t % len(WORDS)] for t in prompt)
            msgs = [{"role": "user", "content": text}]
        specs.append(RequestSpec(i, t, prompt, plen, olen, tenant, msgs))
    return specs


def _approx_tokens(text: str) -> int:
    return max(1, round(len(text.split()) * 1.3))


def load_trace(path: str | Path, *, n: int | None = None, rate: float | None = None, seed: int = 0,
               process: str = "poisson", cv: float = 1.0, time_scale: float = 1.0, tenants: int = 1,
               chat: bool = False, default_output_len: int = 64, maker: PromptMaker | None = None,
               tokenizer=None) -> list[RequestSpec]:
    """A trace file -> specs. Timestamps from the trace (scaled by time_scale) unless `rate` is given or the
    trace has none, in which case arrivals are generated. `tokenizer` (optional, with .encode) measures text."""
    raw = Path(path).read_text()
    rows = json.loads(raw) if raw.lstrip().startswith("[") else [json.loads(l) for l in raw.splitlines() if l.strip()]
    rng = random.Random(seed)
    maker = maker or PromptMaker()
    count = lambda s: len(tokenizer.encode(s)) if tokenizer is not None else _approx_tokens(s)  # noqa: E731
    specs: list[RequestSpec] = []
    for row in rows:
        if n is not None and len(specs) >= n:
            break
        ts = row.get("timestamp", row.get("arrival", row.get("arrival_time")))
        prompt = None
        msgs = None
        olen = row.get("output_len", row.get("output_tokens", row.get("max_tokens")))
        if "conversations" in row:  # ShareGPT
            conv = row["conversations"]
            hi = next((j for j, m in enumerate(conv) if m.get("from") in ("human", "user")), None)
            if hi is None:
                continue
            prompt = conv[hi].get("value", "")
            if olen is None:
                reply = next((m.get("value", "") for m in conv[hi + 1:] if m.get("from") in ("gpt", "assistant")), "")
                olen = count(reply) if reply else default_output_len
            plen = count(prompt)
        elif "messages" in row:
            msgs = row["messages"]
            prompt = "\n".join(str(m.get("content", "")) for m in msgs)
            plen = count(prompt)
        elif "prompt" in row:
            prompt = row["prompt"]
            plen = len(prompt) if isinstance(prompt, list) else count(prompt)
        elif "prompt_len" in row or "input_len" in row:
            plen = int(row.get("prompt_len", row.get("input_len")))
            prompt, plen = maker.make(plen, len(specs) % max(1, tenants), rng, seed)
        else:
            continue
        if not prompt:
            continue
        if chat and msgs is None:
            text = prompt if isinstance(prompt, str) else " ".join(WORDS[t % len(WORDS)] for t in prompt)
            msgs = [{"role": "user", "content": text}]
        specs.append(RequestSpec(len(specs), float(ts) * time_scale if ts is not None else -1.0, prompt, plen,
                                 max(1, int(olen if olen is not None else default_output_len)),
                                 len(specs) % max(1, tenants), msgs))
    if rate is not None or any(s.arrival < 0 for s in specs):
        times = arrivals(len(specs), rate or 1.0, random.Random(seed + 1), process, cv)
        for s, t in zip(specs, times):
            s.arrival = t
    else:
        t0 = min((s.arrival for s in specs), default=0.0)
        for s in specs:
            s.arrival -= t0
        specs.sort(key=lambda s: s.arrival)
        for i, s in enumerate(specs):
            s.idx = i
    return specs
