"""Async OpenAI-compatible streaming client (httpx) and the open-/closed-loop drivers.

Timestamps are `time.perf_counter()` in this process: a request's `scheduled` time is fixed by the seeded
schedule before the run starts; `sent` is taken just before the HTTP request is issued; an emit is the moment a
content-bearing SSE `data:` line is read. Open loop never waits for responses before sending the next request,
so a stalled server shows up in latency measured from `scheduled` (no coordinated omission).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from pdserve.bench.metrics import ClientRecord, describe
from pdserve.bench.workload import RequestSpec


@dataclass
class Target:
    base_url: str                      # http://host:port or http://host:port/v1
    model: str | None = None           # None: the first id from GET /v1/models
    endpoint: str = "completions"      # completions | chat
    api_keys: list[str] = field(default_factory=list)  # tenant t uses api_keys[t % len]
    ignore_eos: bool = True            # send ignore_eos + min_tokens (vLLM/pdserve extension) for exact lengths
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 120.0

    @property
    def v1(self) -> str:
        b = self.base_url.rstrip("/")
        return b if b.endswith("/v1") else b + "/v1"

    def body(self, spec: RequestSpec) -> dict:
        b: dict = {"max_tokens": spec.output_len, "stream": True, "stream_options": {"include_usage": True},
                   "temperature": self.temperature}
        if self.model:
            b["model"] = self.model
        if self.ignore_eos:
            b["ignore_eos"] = True
            b["min_tokens"] = spec.output_len
        if self.endpoint == "chat":
            b["messages"] = spec.messages or [{"role": "user", "content": spec.prompt if isinstance(spec.prompt, str)
                                               else " ".join(map(str, spec.prompt))}]
        else:
            b["prompt"] = spec.prompt
        b.update(self.extra_body)
        return b

    def headers(self, tenant: int) -> dict:
        # pdserve sends `usage.stage_times` only when asked (and the key may see it); other servers ignore this
        h = {"x-pdserve-debug": "stage-times"}
        if self.api_keys:
            h["Authorization"] = f"Bearer {self.api_keys[tenant % len(self.api_keys)]}"
        return h


async def resolve_model(client: httpx.AsyncClient, target: Target) -> None:
    if target.model:
        return
    r = await client.get(target.v1 + "/models", headers=target.headers(0), timeout=10)
    r.raise_for_status()
    target.model = r.json()["data"][0]["id"]


def _content(chunk: dict, chat: bool) -> bool:
    for c in chunk.get("choices") or []:
        if c.get("token_ids"):
            return True
        txt = (c.get("delta") or {}).get("content") if chat else c.get("text")
        if txt:
            return True
    return False


async def send(client: httpx.AsyncClient, target: Target, spec: RequestSpec, rec: ClientRecord) -> ClientRecord:
    """One streamed request; fills rec.sent / emits / usage / ok / error. Never raises (except cancellation)."""
    chat = target.endpoint == "chat"
    url = target.v1 + ("/chat/completions" if chat else "/completions")
    body = target.body(spec)
    done = False
    rec.sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=target.headers(spec.tenant),
                                 timeout=target.timeout_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                rec.error = f"HTTP {resp.status_code}: {text}"
                return rec
            rec.path = resp.headers.get("x-pdserve-path")
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if "error" in chunk and not chunk.get("choices"):
                    err = chunk["error"]
                    rec.error = f"stream error: {err.get('code') or ''} {err.get('message') or err}"[:300]
                    return rec
                if _content(chunk, chat):
                    rec.emits.append(now)
                u = chunk.get("usage")
                if u:
                    rec.prompt_tokens = u.get("prompt_tokens")
                    rec.output_tokens = u.get("completion_tokens")
                    rec.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                    if u.get("stage_times"):  # pdserve's per-request stage timestamps (bench/stages.py)
                        rec.stages = u["stage_times"]
        if not done:
            rec.error = "stream ended without [DONE]"
        elif not rec.emits:
            rec.error = "no tokens emitted"
        else:
            rec.ok = True
    except asyncio.CancelledError:
        rec.error = rec.error or "cancelled (run deadline or interrupt)"
        raise
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
    return rec


class LoopLagMonitor:
    """Event-loop lag: how late a 5 ms sleep wakes up. Large lag = the client itself delays timestamps."""

    def __init__(self, period: float = 0.005):
        self.period = period
        self.samples: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self):
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.period)
            self.samples.append(max(0.0, time.perf_counter() - t - self.period))

    def start(self):
        self._task = asyncio.create_task(self._run())

    async def stop(self):
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


@dataclass
class ClientHealth:
    """The load generator's own lag; `bottleneck` when it may have distorted the measurement."""
    send_lag: dict
    loop_lag: dict
    cpu_fraction_of_one_core: float
    bottleneck: bool
    reasons: list[str]

    def as_dict(self) -> dict:
        return {"send_lag_s": self.send_lag, "event_loop_lag_s": self.loop_lag,
                "cpu_fraction_of_one_core": self.cpu_fraction_of_one_core, "bottleneck": self.bottleneck,
                "reasons": self.reasons}


def client_health(records: list[ClientRecord], loop_lag: list[float], cpu_frac: float, open_loop: bool,
                  lag_threshold_s: float = 0.010) -> ClientHealth:
    lags = [r.sent - r.scheduled for r in records if r.sent is not None]
    sl, ll = describe(lags), describe(loop_lag)
    reasons = []
    if open_loop and lags and sl.get("p99", 0) > lag_threshold_s:
        reasons.append(f"p99 send lag {sl['p99'] * 1e3:.1f} ms > {lag_threshold_s * 1e3:.0f} ms")
    if loop_lag and ll.get("p99", 0) > lag_threshold_s:
        reasons.append(f"p99 event-loop lag {ll['p99'] * 1e3:.1f} ms > {lag_threshold_s * 1e3:.0f} ms")
    if cpu_frac > 0.9:
        reasons.append(f"client used {cpu_frac:.0%} of a core")
    return ClientHealth(sl, ll, cpu_frac, bool(reasons), reasons)


@contextlib.asynccontextmanager
async def _frozen_heap():
    """For the run, what this process already holds is kept out of the collector's full collections, which walk
    every tracked object: a load generator sharing its process with much else (a test session with torch and
    transformers imported holds 200k+ objects, a full collection ~110 ms on this project's CPUs, more as the
    session grows) would otherwise report any such pause as the server's latency. Restored afterwards; `timeit`
    keeps the collector out of its measurements for the same reason."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class LoadGen:
    """Drives one load point. `records` fills in as requests are scheduled, so an interrupted run can still be
    summarised (unfinished requests carry an error and count as SLO misses)."""

    def __init__(self, target: Target, *, max_connections: int = 1024,
                 on_done: Callable[[ClientRecord], None] | None = None):
        self.target = target
        self.max_connections = max_connections
        self.on_done = on_done
        self.records: list[ClientRecord] = []
        self.warmup_records: list[ClientRecord] = []
        self.health: ClientHealth | None = None
        self.t0: float | None = None
        self.mode = ""

    def _client(self) -> httpx.AsyncClient:
        lim = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections)
        return httpx.AsyncClient(limits=lim, timeout=self.target.timeout_s, trust_env=False)

    async def warmup(self, specs: list[RequestSpec]) -> None:
        """Sequential warm-up requests, kept apart in `warmup_records` (the first is the cold-start sample)."""
        if specs:
            async with self._client() as client:
                await resolve_model(client, self.target)
                await self._warmup(client, list(specs))

    async def _warmup(self, client, specs: list[RequestSpec]) -> None:
        for s in specs:  # sequential: the first one is the cold-start sample
            now = time.perf_counter()
            rec = ClientRecord(idx=s.idx, scheduled=now, tenant=s.tenant, warmup=True)
            self.warmup_records.append(rec)
            await send(client, self.target, s, rec)

    async def run_open(self, specs: list[RequestSpec], warmup: list[RequestSpec] = (), *,
                       drain_timeout_s: float = 60.0, lead_s: float = 0.05) -> list[ClientRecord]:
        """Open loop: request i is sent at t0 + specs[i].arrival whatever the server is doing."""
        self.mode = "open-loop"
        return await self._run(specs, warmup, None, drain_timeout_s, lead_s)

    async def run_closed(self, specs: list[RequestSpec], concurrency: int, warmup: list[RequestSpec] = (), *,
                         drain_timeout_s: float = 60.0) -> list[ClientRecord]:
        """Closed loop (coordinated-omission prone, labelled so): `concurrency` users, each sends its next request
        when the previous one finished; scheduled := sent, so latency hides the time a stalled server held users
        back from sending."""
        self.mode = f"closed-loop(concurrency={concurrency})"
        return await self._run(specs, warmup, concurrency, drain_timeout_s, 0.0)

    async def _run(self, specs, warmup, concurrency, drain_timeout_s, lead_s) -> list[ClientRecord]:
        mon = LoopLagMonitor()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        tasks: list[asyncio.Task] = []
        async with self._client() as client, _frozen_heap():
            await resolve_model(client, self.target)
            if warmup:
                await self._warmup(client, list(warmup))
            mon.start()
            self.t0 = t0 = time.perf_counter() + lead_s
            span = max((s.arrival for s in specs), default=0.0)

            async def one(s: RequestSpec, rec: ClientRecord):
                await send(client, self.target, s, rec)
                if self.on_done:
                    self.on_done(rec)

            try:
                if concurrency is None:
                    for s in specs:
                        delay = t0 + s.arrival - time.perf_counter()
                        if delay > 0:
                            await asyncio.sleep(delay)
                        rec = ClientRecord(idx=s.idx, scheduled=t0 + s.arrival, tenant=s.tenant,
                                            prompt_tokens=s.prompt_len if isinstance(s.prompt, list) else None)
                        self.records.append(rec)
                        tasks.append(asyncio.create_task(one(s, rec)))
                    deadline = t0 + span + drain_timeout_s
                else:
                    queue = list(specs)
                    queue.reverse()

                    async def user():
                        while queue:
                            s = queue.pop()
                            now = time.perf_counter()
                            rec = ClientRecord(idx=s.idx, scheduled=now, tenant=s.tenant,
                                                prompt_tokens=s.prompt_len if isinstance(s.prompt, list) else None)
                            self.records.append(rec)
                            await one(s, rec)

                    tasks = [asyncio.create_task(user()) for _ in range(max(1, concurrency))]
                    deadline = t0 + drain_timeout_s + len(specs) * self.target.timeout_s
                if tasks:
                    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
            finally:
                for t in tasks:
                    if not t.done():
                        t.cancel()
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
                for r in self.records:
                    if not r.ok and r.error is None:
                        r.error = "not finished (run deadline or interrupt)"
                await mon.stop()
                cpu = (time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
                self.health = client_health(self.records, mon.samples, cpu, concurrency is None)
        return self.records

