"""A discrete-event simulation of a worker pool driving the REAL router code (policy, cost model, prefix index
through Redis). Used by tests/services/test_routing*.py and bench/routing.py; no model, virtual time.

What is simulated: each worker has a prefill server (FIFO, time = overhead + uncached tokens / rate), a decode
batch (step = base + per_seq * batch), and an LRU prefix cache of chained block hashes computed with the
engine's `block_hash`. What is real: workers publish their cache's stored/evicted events with
`KvEventPublisher` into Redis; the router's `IndexSync` follows the stream (with a propagation delay) and
`Policy.place` decides from the index and from load reports the simulated workers send every `report_s`
(measured with the same EwmaLine estimators as a real worker).
"""
from __future__ import annotations

import heapq
import math
import random
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import KVEvent
from pdserve.services.pb import common_pb2
from pdserve.services.registry import WorkerRecord
from pdserve.services.load_meter import Ewma, EwmaLine
from pdserve.services.router.policy import Placement, RouteInput
from pdserve.services.kv_events import KvEventPublisher
from pdserve.services.router.prefix_index import IndexSync, chain_hashes

FP = "sim-model"
BS = 16


@dataclass
class WorkerSpec:
    role: str = "both"
    prefill_tokens_per_s: float = 4000.0
    prefill_overhead_s: float = 0.01
    decode_step_s: float = 0.01
    decode_step_per_seq_s: float = 0.0004
    cache_blocks: int = 400
    kv_blocks: int = 4000


@dataclass
class SimRequest:
    rid: str
    arrival: float
    prompt: list[int]
    out_tokens: int
    group: int
    worker: str = ""
    decode_worker: str = ""
    hit_tokens: int = 0
    best_hit_tokens: int = 0  # the most any worker held at routing time (per-decision oracle)
    first_token: float = 0.0
    done: float = 0.0


class SimWorker:
    def __init__(self, wid: str, spec: WorkerSpec):
        self.id, self.spec = wid, spec
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.queue: deque[SimRequest] = deque()
        self.busy_until = 0.0
        self.current: SimRequest | None = None
        self.current_left = 0  # uncached tokens of the request in prefill
        self.active = 0
        self.prefill_line = EwmaLine()
        self.decode_now = Ewma()
        self.decode_line = EwmaLine(alpha=0.05)
        self.events: list[KVEvent] = []
        self.served = 0
        self.busy_s = 0.0
        self.computed_tokens = 0

    def cached_prefix(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def store(self, hashes: list[int]) -> None:
        for h in hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                self.events.append(KVEvent("stored", h, ""))
        while len(self.cache) > self.spec.cache_blocks:
            h, _ = self.cache.popitem(last=False)
            self.events.append(KVEvent("evicted", h, ""))

    def record(self, now: float) -> WorkerRecord:
        ov, slope = self.prefill_line.fit()
        # like a real worker's report: queued prompts minus what its cache already holds (load.py)
        pending = sum(len(r.prompt) - BS * self.cached_prefix(chain_hashes(r.prompt, BS, FP, ""))
                      for r in self.queue) + self.current_left
        d0, d1 = self.decode_line.fit()
        return WorkerRecord(self.id, self.spec.role, f"sim:{self.id}", capacity_blocks=self.spec.kv_blocks,
                            layout=common_pb2.KvLayout(fingerprint=FP, block_size=BS, block_bytes=2 * 1024 * 1024),
                            load=common_pb2.LoadReport(
                                num_running=self.active, num_waiting=len(self.queue),
                                kv_blocks_total=self.spec.kv_blocks, kv_blocks_in_use=0,
                                prefill_tokens_per_s=1.0 / slope if slope > 0 else 0.0,
                                prefill_overhead_s=ov, decode_step_s=self.decode_now.value,
                                decode_step_per_seq_s=d1, pending_prefill_tokens=pending,
                                report_time=now), updated=now)


@dataclass
class Workload:
    """Prefix-heavy: `groups` shared system prompts (Zipf popularity), each used by multi-turn chats."""
    groups: int = 16
    system_tokens: int = 512
    chats_per_group: int = 6
    user_tokens: int = 48
    out_tokens: int = 32
    zipf: float = 0.8
    rate: float = 40.0  # requests / s (Poisson)
    n: int = 600
    seed: int = 0
    shared_system: bool = False  # one system prompt for everyone (the herding test)

    def generate(self) -> list[SimRequest]:
        rng = random.Random(self.seed)
        systems = [[rng.randrange(1, 30000) for _ in range(self.system_tokens)] for _ in range(self.groups)]
        if self.shared_system:
            systems = [systems[0]] * self.groups
        weights = [1.0 / (g + 1) ** self.zipf for g in range(self.groups)]
        chats: dict[tuple[int, int], list[int]] = {}
        t = 0.0
        out = []
        for i in range(self.n):
            t += rng.expovariate(self.rate)
            g = rng.choices(range(self.groups), weights)[0]
            c = rng.randrange(self.chats_per_group)
            hist = chats.setdefault((g, c), [])
            user = [rng.randrange(1, 30000) for _ in range(self.user_tokens)]
            prompt = systems[g] + hist + user
            if len(prompt) > 3000:  # a chat that got too long starts over
                hist.clear()
                prompt = systems[g] + user
            answer = [rng.randrange(1, 30000) for _ in range(self.out_tokens)]
            hist.extend(user + answer)  # the next turn carries this one (multi-turn prefix reuse)
            out.append(SimRequest(f"r{i}", t, prompt, self.out_tokens, g))
        return out


class Sim:
    def __init__(self, specs: dict[str, WorkerSpec], policy, redis, model: str | None = None,
                 report_s: float = 0.5, event_delay_s: float = 0.1, xfer_bytes_per_s: float = 5e9):
        self.workers = {w: SimWorker(w, s) for w, s in specs.items()}
        self.policy = policy
        self.redis = redis
        self.model = model or f"sim-{uuid.uuid4().hex[:8]}"
        self.sync = IndexSync(redis, self.model) if redis is not None else None
        if self.sync is not None and hasattr(policy, "index"):
            policy.index = self.sync.index
        if hasattr(policy, "clock"):  # in-flight accounting compares with the reports' (virtual) time
            policy.clock = self.clock
        self.pubs = {w: KvEventPublisher(redis, self.model, w) for w in specs} if redis is not None else {}
        self.report_s = report_s
        self.event_delay_s = event_delay_s
        self.xfer_bytes_per_s = xfer_bytes_per_s
        self.now = 0.0
        self.records: dict[str, WorkerRecord] = {w: x.record(0.0) for w, x in self.workers.items()}
        self._heap: list = []
        self._seq = 0
        self._outbox: list[tuple[float, str, list[KVEvent]]] = []
        self.done: list[SimRequest] = []
        self.decisions: dict[str, int] = {}
        self._reset_done = False

    def clock(self) -> float:
        return self.now

    def _at(self, t: float, kind: str, data) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, data))

    # ---- worker mechanics -------------------------------------------------------------------------------------
    def _start_next(self, w: SimWorker) -> None:
        if w.current is not None or not w.queue:
            return
        r = w.queue.popleft()
        hashes = chain_hashes(r.prompt, BS, FP, "")
        hit = w.cached_prefix(hashes) * BS
        if r.decode_worker and r.decode_worker != w.id:
            r.hit_tokens = hit
        elif not r.decode_worker:
            r.hit_tokens = hit
        uncached = len(r.prompt) - hit
        dur = w.spec.prefill_overhead_s + uncached / w.spec.prefill_tokens_per_s
        w.current, w.current_left = r, uncached
        w.busy_s += dur
        w.computed_tokens += uncached
        w.prefill_line.add(uncached, dur)
        self._at(self.now + dur, "prefill_done", (w.id, r, hashes))

    def _prefill_done(self, wid: str, r: SimRequest, hashes: list[int]) -> None:
        w = self.workers[wid]
        w.store(hashes)
        w.current, w.current_left = None, 0
        if w.events:
            self._outbox.append((self.now + self.event_delay_s, wid, w.events))
            w.events = []
        self._start_next(w)
        if r.decode_worker and r.decode_worker != wid:  # disaggregated: pull the KV
            xfer = len(r.prompt) * 2 * 1024 * 1024 / BS / self.xfer_bytes_per_s
            self._at(self.now + xfer + 0.002, "decode_start", r)
        else:
            self._decode_start(r)

    def _decode_start(self, r: SimRequest) -> None:
        r.first_token = self.now
        w = self.workers[r.decode_worker or r.worker]
        w.active += 1
        step = w.spec.decode_step_s + w.spec.decode_step_per_seq_s * w.active
        w.decode_now.add(step)
        w.decode_line.add(w.active, step)
        self._at(self.now + step * (r.out_tokens - 1), "decode_done", (w.id, r))

    # ---- the loop ---------------------------------------------------------------------------------------------
    async def _flush_events(self) -> None:
        if self.sync is None:
            return
        due = [x for x in self._outbox if x[0] <= self.now]
        self._outbox = [x for x in self._outbox if x[0] > self.now]
        for _, wid, evs in due:
            await self.pubs[wid].publish(evs)
        if due:
            await self.sync.poll(block_ms=None, count=100_000)

    async def run(self, requests: list[SimRequest]) -> "SimResult":
        if self.sync is not None:
            if not self._reset_done:  # a second run continues with the caches as they are
                for p in self.pubs.values():
                    await p.reset()
                self._reset_done = True
            await self.sync.sync_workers(self.workers)
        for r in requests:
            self._at(r.arrival, "arrival", r)
        end = max(r.arrival for r in requests)
        t = self.now
        while t <= end + 1:
            self._at(t, "report", None)
            t += self.report_s
        while self._heap:
            self.now, _, kind, data = heapq.heappop(self._heap)
            if kind == "arrival":
                await self._flush_events()
                await self._route(data)
            elif kind == "prefill_done":
                self._prefill_done(*data)
            elif kind == "decode_start":
                self._decode_start(data)
            elif kind == "decode_done":
                wid, r = data
                self.workers[wid].active -= 1
                r.done = self.now
                self.done.append(r)
            elif kind == "report":
                self.records = {w: x.record(self.now) for w, x in self.workers.items()}
        return SimResult(self)

    async def _route(self, r: SimRequest) -> None:
        hashes = chain_hashes(r.prompt, BS, FP, "")
        r.best_hit_tokens = max(w.cached_prefix(hashes) for w in self.workers.values()
                                if w.spec.role in ("both", "prefill")) * BS
        pl: Placement = self.policy.place(list(self.records.values()),
                                          req=RouteInput(r.rid, r.prompt, len(r.prompt), "", r.out_tokens))
        self.decisions[pl.reason] = self.decisions.get(pl.reason, 0) + 1
        if pl.mode == "disagg":
            r.worker, r.decode_worker = pl.prefill.worker_id, pl.decode.worker_id
        else:
            r.worker = pl.both.worker_id
        w = self.workers[r.worker]
        w.served += 1
        w.queue.append(r)
        self._start_next(w)


@dataclass
class SimResult:
    sim: Sim
    ttft: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.reqs = self.sim.done
        self.ttft = sorted(r.first_token - r.arrival for r in self.reqs)

    @property
    def hit_ratio(self) -> float:
        return sum(r.hit_tokens for r in self.reqs) / max(1, sum(len(r.prompt) for r in self.reqs))

    @property
    def oracle_hit_ratio(self) -> float:
        return sum(r.best_hit_tokens for r in self.reqs) / max(1, sum(len(r.prompt) for r in self.reqs))

    def served(self) -> dict[str, int]:
        return {w: x.served for w, x in self.sim.workers.items()}

    def busy(self) -> dict[str, float]:
        return {w: x.busy_s for w, x in self.sim.workers.items()}

    def pct(self, q: float) -> float:
        return self.ttft[min(len(self.ttft) - 1, int(math.ceil(q * len(self.ttft))) - 1)]

    @property
    def mean_ttft(self) -> float:
        return sum(self.ttft) / len(self.ttft)

    def goodput(self, ttft_slo_s: float, tpot_slo_s: float = 1.0) -> float:
        """Requests per second meeting both SLOs (spec §2.2: a rate, not a ratio)."""
        ok = [r for r in self.reqs if r.first_token - r.arrival <= ttft_slo_s
              and (r.done - r.first_token) / max(1, r.out_tokens - 1) <= tpot_slo_s]
        span = max(r.done for r in self.reqs) - min(r.arrival for r in self.reqs)
        return len(ok) / span


# ---- baseline policies (same interface as Policy.place) ---------------------------------------------------------
class RoundRobin:
    def __init__(self):
        self.i = 0

    def place(self, workers: list[WorkerRecord], req: RouteInput) -> Placement:
        ws = sorted((w for w in workers if w.role == "both"), key=lambda w: w.worker_id)
        self.i += 1
        return Placement("colocated", both=ws[self.i % len(ws)], reason="round_robin")


class LeastLoaded:
    """Least outstanding work by the last report plus what it placed since (the classic baseline)."""

    def __init__(self, rng: random.Random | None = None, clock=None):
        self.rng = rng or random.Random(0)
        self.clock = clock
        self.placed: dict[str, list[tuple[float, int]]] = {}

    def place(self, workers: list[WorkerRecord], req: RouteInput) -> Placement:
        def load(w):
            since = [n for t, n in self.placed.get(w.worker_id, []) if t > w.load.report_time]
            return w.load.pending_prefill_tokens + sum(since) + 100 * w.load.num_running
        ws = [w for w in workers if w.role == "both"]
        best = min(load(w) for w in ws)
        w = self.rng.choice([w for w in ws if load(w) == best])
        self.placed.setdefault(w.worker_id, []).append((self.clock() if self.clock else 0.0, req.n_prompt))
        return Placement("colocated", both=w, reason="least_loaded")


class Oracle:
    """Knows every cache exactly: the longest actual cached prefix wins (ties: least loaded). Max hit ratio."""

    def __init__(self, sim_ref: list, rng: random.Random | None = None):
        self.sim_ref = sim_ref
        self.rng = rng or random.Random(0)

    def place(self, workers: list[WorkerRecord], req: RouteInput) -> Placement:
        sim = self.sim_ref[0]
        hashes = chain_hashes(req.prompt_token_ids, BS, FP, "")
        ws = [w for w in workers if w.role == "both"]
        hits = {w.worker_id: sim.workers[w.worker_id].cached_prefix(hashes) for w in ws}
        best = max(hits.values())
        cands = [w for w in ws if hits[w.worker_id] == best]
        q = {w.worker_id: len(sim.workers[w.worker_id].queue) for w in cands}
        m = min(q.values())
        return Placement("colocated", both=self.rng.choice([w for w in cands if q[w.worker_id] == m]),
                         reason="oracle")
