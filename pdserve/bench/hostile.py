"""Hostile neighbours: a normal client's latency while attackers take turns (docs/reliability.md, "Hostile
neighbours").

    python -m pdserve.bench.hostile --base-url http://127.0.0.1:8000 --phase-s 10

A normal client streams small completions back to back and times each one's first token (TTFT). Phases run in
turn, `--phase-s` seconds each: `baseline` (nobody else), then one per attack, the attacker sending one request
every `--interval` seconds without waiting for the answers (as a client with a script would). Reported per phase:
the normal client's TTFT p50/p99/max, its non-200 answers, the attackers' status codes, and the workers the
gateway's /health counts (a worker whose engine froze leaves the registry and the count drops).

The attacks, each one client request that used to take service away from everybody:
- `grammar`: a JSON schema with an enum of `--enum-values` distinct values, new strings every time (no cache
  helps). At the defaults the gateway refuses it at once (--max-enum-values); a deployment started with the
  limits raised shows the compile isolation itself: the compile runs in a worker's compiler process and is
  killed at --grammar-compile-timeout.
- `contentless`: 61k `{"role": "user"}` messages (976 KB): rendered on the gateway's event loop before.
- `echo`: echo + logprobs 20 over 300 prompts x 300 tokens: the answer was built on the loop, past its deadline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

ATTACKS = ("grammar", "contentless", "echo")


def grammar_body(model: str, n: int, tag: str) -> dict:
    schema = {"enum": [f"{tag}{i}" for i in range(n)]}
    return {"model": model, "prompt": "a", "max_tokens": 5, "timeout": 10,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def contentless_body(model: str, n: int = 61_000) -> dict:  # 976 KB as compact JSON
    return {"model": model, "messages": [{"role": "user"}] * n, "max_tokens": 1}


def echo_body(model: str, prompts: int = 300, tokens: int = 300) -> dict:
    return {"model": model, "prompt": [[(7 + i + j) % 200 + 3 for j in range(tokens)] for i in range(prompts)],
            "echo": True, "logprobs": 20, "max_tokens": 0, "timeout": 60}


def attack_request(kind: str, model: str, i: int, enum_values: int) -> tuple[str, dict]:
    if kind == "grammar":
        return "/v1/completions", grammar_body(model, enum_values, f"{time.monotonic_ns()}-{i}-")
    if kind == "contentless":
        return "/v1/chat/completions", contentless_body(model)
    if kind == "echo":
        return "/v1/completions", echo_body(model)
    raise ValueError(f"unknown attack {kind!r}")


@dataclass
class Phase:
    name: str
    ttft: list[float] = field(default_factory=list)
    normal_status: Counter = field(default_factory=Counter)
    attack_status: Counter = field(default_factory=Counter)
    attack_seconds: list[float] = field(default_factory=list)
    attack_sample: dict = field(default_factory=dict)  # status -> the first answer's start (what it said)
    workers_min: int | None = None

    def pct(self, q: float) -> float:
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    def row(self) -> dict:
        return {"phase": self.name, "requests": len(self.ttft), "ttft_p50_ms": round(self.pct(0.5) * 1e3, 1),
                "ttft_p99_ms": round(self.pct(0.99) * 1e3, 1),
                "ttft_max_ms": round(max(self.ttft, default=float("nan")) * 1e3, 1),
                "normal_status": dict(self.normal_status), "attack_status": dict(self.attack_status),
                "attack_p50_s": round(sorted(self.attack_seconds)[len(self.attack_seconds) // 2], 3)
                if self.attack_seconds else None,
                "workers_min": self.workers_min, "attack_sample": self.attack_sample}


async def _normal(client: httpx.AsyncClient, model: str, phase: Phase, until: float) -> None:
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 4, "stream": True, "timeout": 30}
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                phase.normal_status[r.status_code] += 1
                first = None
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data:"):
                        first = time.monotonic() - t0
                if first is not None and r.status_code == 200:
                    phase.ttft.append(first)
        except httpx.HTTPError as e:
            phase.normal_status[type(e).__name__] += 1


async def _attacker(client: httpx.AsyncClient, kind: str, model: str, phase: Phase, until: float,
                    interval: float, enum_values: int) -> None:
    async def one(i: int) -> None:
        path, body = attack_request(kind, model, i, enum_values)
        raw = json.dumps(body, separators=(",", ":")).encode()
        t0 = time.monotonic()
        try:
            r = await client.post(path, content=raw, headers={"content-type": "application/json"}, timeout=90)
            phase.attack_status[r.status_code] += 1
            phase.attack_sample.setdefault(r.status_code, r.text[:300])
        except httpx.HTTPError as e:
            phase.attack_status[type(e).__name__] += 1
        phase.attack_seconds.append(time.monotonic() - t0)

    tasks, i = [], 0
    while time.monotonic() < until:
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        await asyncio.sleep(interval)
    await asyncio.gather(*tasks)


async def _workers(client: httpx.AsyncClient, phase: Phase, until: float) -> None:
    while time.monotonic() < until:
        try:
            r = await client.get("/health", timeout=5)
            n = sum(r.json().get("workers", {}).values())
        except (httpx.HTTPError, ValueError):
            n = 0
        phase.workers_min = n if phase.workers_min is None else min(phase.workers_min, n)
        await asyncio.sleep(0.5)


async def run(base_url: str, model: str, attacks=ATTACKS, phase_s: float = 6.0, interval: float = 1.0,
              enum_values: int = 60_000, headers: dict | None = None) -> list[dict]:
    """The baseline phase, then one phase per attack; one row each (Phase.row)."""
    rows = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=20)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits, headers=headers) as client:
        for name in ("baseline", *attacks):
            phase = Phase(name)
            until = time.monotonic() + phase_s
            jobs = [_normal(client, model, phase, until), _workers(client, phase, until)]
            if name != "baseline":
                jobs.append(_attacker(client, name, model, phase, until, interval, enum_values))
            await asyncio.gather(*jobs)
            rows.append(phase.row())
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--phase-s", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--enum-values", type=int, default=60_000)
    ap.add_argument("--api-key", default=None)
    a = ap.parse_args(argv)
    from pdserve.bench.chaos import cpu_model
    print(cpu_model())
    headers = {"authorization": f"Bearer {a.api_key}"} if a.api_key else None
    rows = asyncio.run(run(a.base_url, a.model, a.attacks.split(","), a.phase_s, a.interval, a.enum_values,
                           headers))
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
