"""The fault matrix: faults injected into a live `pdserve up` under open-loop load, and what each
left behind. Driven by `bench/chaos.py` (every case, figures in docs/reliability.md) and, CI-sized, by
`tests/e2e/test_chaos.py`. The same `run_case` drives the link faults on the lab's emulated hosts
(`bench/chaos.py --lab`, chaos_lab.py): a case only needs a `Deployment`.

Per case: an open-loop (Poisson) stream of requests, each streamed and tagged with its own `x-request-id`, split
round-robin over the gateways (a second gateway process is started next to `up`'s, on the same router and Redis:
`up` runs one); the fault at a fixed time into the load; then the load stops, every request ends, and the case
reports:

- requests sent / finished (`[DONE]` after every token) / failed with an error (HTTP error, error event, broken
  connection), migrated (`pdserve_migrations_total` on the gateways, 0 where the family is absent);
- KV blocks in use and pinned on every worker and reservations in Redis once settled (target 0);
- usage records per request id, read from the gateways' billing log lines (target exactly one each);
- the longest a client waited for its error, counted from its send or from the fault if later (target: 2
  heartbeat TTLs), and the longest silence between two tokens of a request that finished;
- recovery: from the fault until the requests sent from then on are served (the last failed request's send time
  minus the fault time; 0 when none failed after it).

The load generator is this module's own (not pdserve/bench/client.py's): a fault case needs per-request ids and
the time each error arrived, which the benchmark client does not record.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from pdserve.services.leftovers import BLOCKS, Leftovers, metric_sum, read_leftovers, scrape, settle
from pdserve.services.up_process import UpProcess

MIGRATIONS = "pdserve_migrations_total"


# ---- the client side -----------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    rid: str
    sent: float                  # perf_counter
    end: float | None = None     # [DONE] or the error
    tokens: int = 0
    ok: bool = False
    answered: bool = False       # response headers arrived: a gateway admitted it (its usage record is open)
    error: str | None = None
    max_gap: float = 0.0         # longest silence between two data events (from the send for the first)
    prompt: list[int] = field(default_factory=list)
    text: str = ""               # what the client was streamed


async def _one(client: httpx.AsyncClient, base: str, model: str, rid: str, prompt: list[int], max_tokens: int,
               timeout_s: float) -> Outcome:
    o = Outcome(rid, time.perf_counter(), prompt=prompt)
    last = o.sent
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "timeout": timeout_s, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", base + "/v1/completions", json=body, headers={"x-request-id": rid},
                                 timeout=timeout_s + 10) as r:
            o.answered = True
            if r.status_code != 200:
                o.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return o
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                o.max_gap, last = max(o.max_gap, now - last), now
                if line == "data: [DONE]":
                    o.ok = o.tokens >= max_tokens
                    if not o.ok:
                        o.error = f"[DONE] after {o.tokens} of {max_tokens} tokens"
                    return o
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    o.error = f"error event: {chunk['error'].get('code')}"
                    return o
                if chunk.get("usage"):  # the last chunk before [DONE]: the tokens the client was sent
                    o.tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices") or ():
                    o.text += c.get("text") or ""
            o.error = "stream ended without [DONE]"
    except (httpx.HTTPError, OSError) as e:
        o.error = f"{type(e).__name__}: {e}"[:160]
    finally:
        o.end = time.perf_counter()
    return o


async def open_loop(bases: list[str], model: str, tag: str, rate: float, duration: float, seed: int = 0,
                    prompt_len: int = 40, max_tokens: int = 24, timeout_s: float = 30.0) -> list[Outcome]:
    """Poisson arrivals at `rate` for `duration` s, round-robin over `bases`; never waits for a response before
    the next send. Each prompt is distinct (no prefix cache hits across requests)."""
    rng = random.Random(seed)
    tasks = []
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=0)  # a fresh connection each: a dead
    async with httpx.AsyncClient(limits=limits) as client:                   # gateway cannot poison a pool
        t0 = time.perf_counter()
        t, i = 0.0, 0
        while t < duration:
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            prompt = [rng.randrange(20, 250) for _ in range(prompt_len)]
            tasks.append(asyncio.create_task(_one(client, bases[i % len(bases)], model, f"chaos-{tag}-{i}", prompt,
                                                  max_tokens, timeout_s)))
            i += 1
            t += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


async def _storm_one(port: int, model: str, rid: str, stage: int, read_events: int) -> Outcome:
    """A stream on a raw socket, dropped with RST at `stage` (tests/e2e/test_abort_storm.py): 0 right after the
    request is sent, 1 after the response head, 2 after the first data event, 3 after `read_events`, 4 never."""
    body = json.dumps({"model": model, "prompt": list(range(20, 100)), "max_tokens": 64, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    o = Outcome(rid, time.perf_counter())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"x-request-id: %s\r\nContent-Length: %d\r\n\r\n" % (rid.encode(), len(body)) + body)
        await writer.drain()
        o.answered = True  # its gateway stays up in the storm: a request sent whole is one it received, record due
        if stage == 0:
            return o
        await reader.readuntil(b"\r\n\r\n")
        if stage == 1:
            return o
        want = {2: 1, 3: read_events, 4: 1 << 30}[stage]
        buf = b""
        while o.tokens < want:
            chunk = await reader.read(1 << 16)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf and o.tokens < want:
                ev, buf = buf.split(b"\n\n", 1)
                if b"data: [DONE]" in ev:
                    o.ok = True
                    return o
                o.tokens += b'"choices": [{' in ev or b'"choices":[{' in ev
        return o
    finally:
        o.end = time.perf_counter()
        writer.transport.abort()


async def abort_storm(ports: list[int], model: str, tag: str, n: int, concurrency: int = 16,
                      seed: int = 13) -> list[Outcome]:
    rng = random.Random(seed)
    plan = [rng.choice((0, 1, 2, 2, 3, 3, 4)) for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, stage: int) -> Outcome:
        async with sem:
            return await _storm_one(ports[i % len(ports)], model, f"chaos-{tag}-{i}", stage, rng.randint(2, 12))

    return list(await asyncio.gather(*[one(i, s) for i, s in enumerate(plan)]))


# ---- the deployment ------------------------------------------------------------------------------------------------
class Deployment(Protocol):
    """What `run_case` needs of a deployment under test: a one-host `pdserve up` (ChaosDeployment) or a deployment
    on the lab's emulated hosts (chaos_lab.LabChaosDeployment)."""

    served: str
    ttl: float  # the workers' heartbeat TTL

    @property
    def bases(self) -> list[str]: ...  # the gateways' base URLs; the load is spread over them

    def wait_ready(self, timeout: float = 90.0) -> bool: ...

    # awaited at the fault time; returns when the fault is over, with what it met (a note for the row) or None
    def fault(self, case: str) -> Callable[[], Awaitable[str | None]]: ...

    def leftovers(self) -> Leftovers: ...

    def migrations(self) -> float: ...  # pdserve_migrations_total summed over the gateways

    def log_lines(self) -> list[str]: ...  # the gateways' log lines so far (billing records, FAILED reasons)

    def after_case(self, case: str) -> None: ...  # put back what the case took away, where the deployment does not


def _metrics(port: int) -> str:
    return scrape(f"http://127.0.0.1:{port}/metrics")



def gateway_migrations(metrics_urls: list[str]) -> float:
    """`pdserve_migrations_total` over the gateways that answer (a killed one counts 0)."""
    total = 0.0
    for url in metrics_urls:
        try:
            total += metric_sum(scrape(url), MIGRATIONS)
        except Exception:  # noqa: BLE001
            pass
    return total


def records(lines: list[str], prefix: str) -> dict[str, list[dict]]:
    """The usage records in gateway log lines, per request id (ids starting with `prefix`)."""
    out: dict[str, list[dict]] = {}
    for line in lines:
        # text log format: `... INFO pdserve.billing [<x-request-id>]: {record}` (the record's own
        # request_id is the completion id)
        m = _BILLING.search(line)
        if m and m.group(1).startswith(prefix):
            try:
                rec = json.loads(line[m.end() - 1:])
            except ValueError:
                rec = {}
            out.setdefault(m.group(1), []).append(rec)
    return out


def billing(lines: list[str], prefix: str) -> Counter:
    """Usage records per request id (ids starting with `prefix`)."""
    return Counter({rid: len(recs) for rid, recs in records(lines, prefix).items()})


class ChaosDeployment:
    """`pdserve up --mode disagg` (1 prefill, 2 decode workers) and a second gateway on the same router/Redis."""

    def __init__(self, model: str, served: str, env: dict, heartbeat_ttl: float = 2.0, decode: int = 2,
                 extra: tuple[str, ...] = (), log_dir: Path | None = None):
        from pdserve.services.ports import free_port
        self.model, self.served, self.env, self.ttl = model, served, env, heartbeat_ttl
        self.n_decode = decode
        self.up = UpProcess(["--model", model, "--served-model-name", served, "--mode", "disagg", "--prefill", "1",
                             "--decode", str(decode), "--heartbeat-ttl", str(heartbeat_ttl), "--lease-ttl", "10",
                             "--drain-timeout", "3", *extra], env, 180)
        self.log = (log_dir or Path("/tmp")) / f"chaos-gateway2-{os.getpid()}.log"
        self.gw2_port = free_port()
        self.gw2 = None
        self.start_gateway2()

    def start_gateway2(self) -> None:
        router = self.up.process("router")
        cmd = [sys.executable, "-m", "pdserve", "gateway", "--model", self.model, "--served-model-name", self.served,
               "--port", str(self.gw2_port), "--router", f"127.0.0.1:{router['port']}",
               "--redis-url", self.up.info["redis_url"], *self.up.security_flags()]
        from pdserve.services.supervisor import _tie_to_parent
        with open(self.log, "ab") as f:
            self.gw2 = subprocess.Popen(cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                        preexec_fn=_tie_to_parent(os.getpid()))

    @property
    def bases(self) -> list[str]:
        return [self.up.base_url, f"http://127.0.0.1:{self.gw2_port}"]

    @property
    def gateway_ports(self) -> list[int]:
        return [self.up.port, self.gw2_port]

    def workers(self, role: str | None = None) -> list[dict]:
        return self.up.workers(role)

    def healthy(self) -> bool:
        for base in self.bases:
            try:
                with urllib.request.urlopen(base + "/health", timeout=3) as r:
                    seen = json.loads(r.read()).get("workers", {})
                if seen.get("prefill", 0) < 1 or seen.get("decode", 0) < self.n_decode:
                    return False
            except Exception:
                return False
        return all(p.get("pid") and _running(p["pid"]) for p in self.up.info["processes"])

    def wait_ready(self, timeout: float = 90.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.healthy():
                return True
            time.sleep(0.25)
        return False

    def leftovers(self) -> Leftovers:
        """KV blocks in use / pinned on every worker, reservations in Redis (None where unreadable)."""
        return read_leftovers({w["name"]: f"http://127.0.0.1:{w['metrics_port']}/metrics" for w in self.workers()},
                              lambda: self.up.redis(socket_timeout=2), self.served)

    def migrations(self) -> float:
        return gateway_migrations([f"http://127.0.0.1:{p}/metrics" for p in self.gateway_ports])

    def log_lines(self) -> list[str]:
        """`up`'s output (its gateway's lines among them) and the second gateway's log."""
        lines = list(self.up.lines)
        with open(self.log, errors="replace") as f:
            lines += f.readlines()
        return lines

    def fault(self, case: str) -> Callable[[], Awaitable[str | None]]:
        return fault(case, self)

    def after_case(self, case: str) -> None:
        # `up` restarts its own children; the second gateway is this harness's
        if case == "kill-gateway" and self.gw2.poll() is not None:
            self.start_gateway2()

    def stop(self) -> None:
        if self.gw2 is not None and self.gw2.poll() is None:
            self.gw2.terminate()
            try:
                self.gw2.wait(10)
            except subprocess.TimeoutExpired:
                self.gw2.kill()
        self.up.stop()


def _kind(error: str | None) -> str:
    """`HTTP 503 no_workers`, `error event failed`, `ConnectError`, ...: what the table counts."""
    m = re.search(r'"code":\s*"([^"]+)"', error or "")
    return re.sub(r"[:(].*", "", error or "?") + (f" {m.group(1)}" if m else "")


_BILLING = re.compile(r"pdserve\.billing \[([^\]]+)\]: \{")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


# ---- the faults ----------------------------------------------------------------------------------------------------
def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


async def _sigstop(pid: int, seconds: float) -> None:
    _kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        _kill(pid, signal.SIGCONT)


def fault(case: str, dep: ChaosDeployment):
    """The coroutine that injects `case` (awaited at the fault time; returns when the fault is over)."""
    prefill = dep.workers("prefill")[0]
    ttl = dep.ttl

    def busiest_decode() -> dict:
        """The decode worker holding the most KV blocks right now: the fault finds streams in flight."""
        def held(w: dict) -> float:
            try:
                return metric_sum(_metrics(w["metrics_port"]), BLOCKS)
            except Exception:
                return -1.0
        return max(dep.workers("decode"), key=held)

    async def run() -> None:
        decode = busiest_decode()
        if case == "kill-decode":
            _kill(decode["pid"], signal.SIGKILL)
        elif case == "kill-prefill":
            _kill(prefill["pid"], signal.SIGKILL)
        elif case == "kill-router":
            _kill(dep.up.process("router")["pid"], signal.SIGKILL)
        elif case == "kill-gateway":  # `up`'s gateway, one of the two the load is spread over (up restarts it)
            _kill(dep.up.process("gateway")["pid"], signal.SIGKILL)
        elif case == "kill-redis":
            _kill(dep.up.process("redis")["pid"], signal.SIGKILL)
        elif case == "restart-prefill":  # SIGTERM: drains (up to --drain-timeout), then up restarts it
            _kill(prefill["pid"], signal.SIGTERM)
        elif case == "partition-decode":  # silent for 3 heartbeat TTLs: its registry entry lapses
            await _sigstop(decode["pid"], 3 * ttl)
        elif case == "slow-decode":  # SIGSTOP bursts: 0.3 s stopped of every 0.6 s, for 4 s
            for _ in range(7):
                await _sigstop(decode["pid"], 0.3)
                await asyncio.sleep(0.3)
        else:
            raise ValueError(f"unknown case {case}")

    return run


CASES = ("abort-storm", "kill-decode", "kill-prefill", "kill-router", "kill-gateway", "kill-redis",
         "restart-prefill", "partition-decode", "slow-decode")


@dataclass
class CaseResult:
    case: str
    sent: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0               # abort storm: dropped by the client on purpose
    refused: int = 0                 # of the failed: connection refused (no gateway got them: no record due)
    unanswered: int = 0              # of the failed: no response headers (its gateway died before or after
    #                                  admitting it: 0 or 1 record, never 2; the client cannot tell which)
    migrated: int = 0
    blocks_left: int | None = None
    pinned_left: int | None = None
    reservations_left: int | None = None
    records_one: int = 0             # request ids with exactly one usage record
    records_missing: int = 0
    records_dup: int = 0
    max_error_wait_s: float = 0.0
    max_stall_s: float = 0.0         # longest silence inside a request that finished
    recovery_s: float = 0.0
    settle_s: float | None = None    # after the load ended, until blocks/pinned/reservations read 0
    errors: dict = field(default_factory=dict)  # error kind -> count
    reasons: dict = field(default_factory=dict)  # the gateways' `ended FAILED: <why>` lines, first 60 chars -> count
    early_failures: int = 0          # of the failed: ended before the fault (left over from an earlier case)
    deadline_s: float = 0.0          # each request's `timeout`
    longest_s: float = 0.0           # the longest any request took, from its send to its end ([DONE] or error)
    past_deadline: int = 0           # requests that ended more than 2 s after their deadline (target 0)
    fault_note: str = ""             # what the fault met, where it says (pinned KV at a cut, packets held, ...)
    samples: dict = field(default_factory=dict)  # error kind -> its first message (what a 503 said, ...)
    migrated_streams: int = 0        # requests whose record counts a migration (a stream moved mid-flight)
    migrated_finished: int = 0       # of them: finished, every token
    greedy_equal: int = 0            # of those: the same text as the same request sent again, alone, afterwards
    control_equal: str = ""          # the same check on a few requests that did not move: "k/n"
    diverged: list = field(default_factory=list)  # per mismatch: "moved|stayed: first differing char / length"

    def row(self) -> dict:
        return asdict(self)


# a request may end this long after its deadline and still count as on time: the deadline is the gateway's, the
# clock here is the client's, and the error or last event still has to cross a (maybe faulty) link
DEADLINE_SLACK_S = 2.0


def run_case(dep: Deployment, case: str, *, rate: float = 8.0, duration: float = 6.0, fault_at: float = 2.0,
             storm: int = 1000, settle_timeout: float = 20.0, seed: int = 0, max_tokens: int = 24,
             greedy_check: bool = True, timeout_s: float = 30.0, prompt_len: int = 40) -> CaseResult:
    """One case on a ready deployment; leaves it ready again (restarted processes included) when it can.
    `timeout_s`: each request's deadline (its `timeout`); `prompt_len`: tokens per prompt (the KV each moves)."""
    if not dep.wait_ready(120):
        raise RuntimeError(f"deployment not ready before {case}")
    tag = f"{case}-{seed}-{int(time.time() * 1000) % 10**8}"
    res = CaseResult(case, deadline_s=timeout_s)
    mig0 = dep.migrations()
    t_fault = None

    async def main() -> list[Outcome]:
        nonlocal t_fault
        if case == "abort-storm":
            return await abort_storm(dep.gateway_ports, dep.served, tag, storm, seed=seed + 13)
        inject = dep.fault(case)

        async def at_fault() -> None:
            nonlocal t_fault
            await asyncio.sleep(fault_at)
            t_fault = time.perf_counter()
            res.fault_note = await inject() or ""

        load = asyncio.create_task(open_loop(dep.bases, dep.served, tag, rate, duration, seed, max_tokens=max_tokens,
                                             timeout_s=timeout_s, prompt_len=prompt_len))
        await at_fault()
        return await load

    outs = asyncio.run(main())
    res.sent = len(outs)
    if case == "abort-storm":
        res.finished = sum(o.ok for o in outs)
        res.cancelled = res.sent - res.finished
    else:
        res.finished = sum(o.ok for o in outs)
        failed = [o for o in outs if not o.ok]
        res.failed = len(failed)
        res.errors = dict(Counter(_kind(o.error) for o in failed))
        for o in failed:
            res.samples.setdefault(_kind(o.error), (o.error or "")[:240])
        res.refused = sum((o.error or "").startswith("ConnectError") for o in failed)
        if failed:
            late = [o for o in failed if t_fault is None or o.end >= t_fault]
            res.early_failures = len(failed) - len(late)
            res.max_error_wait_s = round(max((o.end - max(o.sent, t_fault or o.sent) for o in late), default=0.0), 3)
            res.recovery_s = round(max(0.0, max(o.sent for o in failed) - t_fault), 3) if t_fault else 0.0
        res.max_stall_s = round(max((o.max_gap for o in outs if o.ok), default=0.0), 3)
        took = [o.end - o.sent for o in outs]
        res.longest_s = round(max(took, default=0.0), 2)
        res.past_deadline = sum(t > timeout_s + DEADLINE_SLACK_S for t in took)
    # everything released: poll until zero (or the timeout)
    left, res.settle_s = settle(dep.leftovers, settle_timeout)
    res.blocks_left, res.pinned_left, res.reservations_left = left.blocks, left.pinned, left.reservations
    # the records: the gateways write them at each request's end (shielded tasks), give them a moment
    # a request that got response headers was admitted: exactly one record is due. One whose gateway died before
    # answering may or may not have been admitted (as with any HTTP server that dies): 0 or 1 record, never 2.
    want = {o.rid for o in outs if o.answered}
    maybe = {o.rid for o in outs if not o.answered and not (o.error or "").startswith("ConnectError")}
    res.unanswered = len(maybe)
    end = time.monotonic() + 10
    while True:
        seen = billing(dep.log_lines(), f"chaos-{tag}-")
        if all(seen[r] >= 1 for r in want) or time.monotonic() > end:
            break
        time.sleep(0.2)
    res.reasons = dict(Counter(re.sub(r"\d+", "N", m.group(1))[:60] for line in dep.log_lines()
                               if f"chaos-{tag}-" in line and (m := re.search(r"ended FAILED: (.*)", line))))
    res.records_one = sum(seen[r] == 1 for r in want)  # of the requests a gateway answered
    res.records_missing = sum(seen[r] == 0 for r in want)
    res.records_dup = sum(seen[r] > 1 for r in want | maybe)
    recs = records(dep.log_lines(), f"chaos-{tag}-")
    moved = [o for o in outs if any(r.get("migrations") for r in recs.get(o.rid, ()))]
    res.migrated_streams = len(moved)
    res.migrated_finished = sum(o.ok for o in moved)
    # control: as many that did not move (at most 16): batched greedy decoding is not bit-reproducible across
    # batch compositions (spec §1.6), so a re-run can differ for a stream that never moved too
    # (greedy_check=False: a caller that asserts none of it skips the re-runs)
    stayed, same = [], []
    if greedy_check:
        stayed = [o for o in outs if o.ok and o not in moved][:max(0, min(16, len(moved) * 2))]
        same = _greedy_again(dep, [o for o in moved if o.ok] + stayed, max_tokens)
    res.greedy_equal = sum(x is True for x in same[:res.migrated_finished])
    res.control_equal = f"{sum(x is True for x in same[res.migrated_finished:])}/{len(stayed)}" if greedy_check \
        else "not checked"
    res.diverged = [f"{'moved' if i < res.migrated_finished else 'stayed'} {x}" for i, x in enumerate(same)
                    if x is not True]
    res.migrated = int(dep.migrations() - mig0) if case != "kill-gateway" else int(max(0.0, dep.migrations() - mig0))
    dep.after_case(case)
    dep.wait_ready(120)
    return res


def _greedy_again(dep: Deployment, outs: list[Outcome], max_tokens: int) -> list[bool | str]:
    """Each request sent again, alone (greedy, same prompt and length): True when its text is the one it was
    streamed, else where they part ("at char i of n"). The reference for a migrated stream is an uninterrupted
    run of the same request on the same deployment."""
    same = []
    for o in outs:
        ok: bool | str = "no gateway answered"
        for base in dep.bases:  # after kill-gateway, up's may still be restarting
            try:
                r = httpx.post(base + "/v1/completions", timeout=60, json={
                    "model": dep.served, "prompt": o.prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0})
            except httpx.HTTPError:
                continue
            if r.status_code != 200:
                ok = f"re-run HTTP {r.status_code}"
                break
            want = r.json()["choices"][0]["text"]
            i = next((k for k, (a, b) in enumerate(zip(want, o.text)) if a != b), min(len(want), len(o.text)))
            ok = True if want == o.text else f"at char {i} of {len(want)}"
            break
        same.append(ok)
    return same


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
        flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
        keep = [f for f in flags if f in ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")]
        return f"{name}, {os.cpu_count()} vCPUs, {' '.join(keep)}; load average {os.getloadavg()[0]:.1f}"
    except Exception:
        return "?"
