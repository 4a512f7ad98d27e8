"""Discrete-event cluster: replicas (colocated `both`, or `prefill` + `decode` pools), the router's placement
policy, KV handoff = transfer time on a link, virtual time.

Event flow per request (mirrors the gateway / prefill / decode services):
  colocated: arrival -> place on a `both` replica -> queued in its real scheduler -> tokens emitted at the end of
             the steps that sample them.
  disagg:    arrival -> place (prefill p, decode d) -> prefill-only request on p; its first token is sampled at
             the end of the step that finishes the prompt, the prompt blocks stay pinned on p -> d allocates
             blocks (`add_prefilled`; retried at d's step boundaries while d is short of blocks) -> KV transfer of
             the blocks d's prefix cache lacks (cost model `transfer_time`) -> p releases its pinned blocks, d
             commits: the first token is emitted to the client then (the real decode stream's first message),
             and the request joins d's decode batch.
Placement: `RouterPlacer` wraps the real `pdserve.services.router.policy.Policy` over `WorkerRecord`s that carry
the replicas' load, refreshed every `report_s` of virtual time (the workers' heartbeat), so the policy sees load
as stale as it does in a deployment.
"""
from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from pdserve.engine.config import EngineConfig
from pdserve.sim.admission import AdmissionSpec, SimAdmission, capacity_of
from pdserve.sim.executor import SimReplica, SimRequest
from pdserve.sim.workload import RequestRecord, summarize


@dataclass
class ClusterSpec:
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    num_blocks: int = 4096           # KV blocks per replica
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_model_len: int | None = None
    report_s: float = 1.0            # load-report interval seen by the router (0: exact load every placement)
    seed: int = 0
    router_mode: str | None = None   # the router's mode; default: disagg with P/D pools, colocated otherwise
    # the gateway's admission stage (on in every `pdserve up`); None = off (e.g. against a bare in-process Engine)
    admission: AdmissionSpec | None = field(default_factory=AdmissionSpec)

    @property
    def replicas(self) -> int:
        return self.prefill + self.decode + self.colocated

    def label(self) -> str:
        parts = []
        if self.prefill or self.decode:
            parts.append(f"{self.prefill}P+{self.decode}D")
        if self.colocated:
            parts.append(f"{self.colocated}C")
        return "+".join(parts) or "empty"


class RouterPlacer:
    """The router's real `Policy` (cost model, prefix index, in-flight bookkeeping) over simulated workers.

    Load reports are rebuilt every `report_s` of virtual time from the replicas' real scheduler/block-manager
    state, with the rates a worker would have measured taken from the sim's cost model; the policy's clock is
    virtual time, so it ages reports and in-flight placements as in a deployment. The prefix index is fed with
    the replicas' real BlockManager stored/evicted events at each report. With pools larger than `candidates`,
    each decision sees a random sample of `candidates` workers per pool (power-of-k choices): the policy scores
    every (prefill, decode) pair, which is O(P x D) per request and too slow at 64 x 64 in a simulation; this
    sampling is the sim's, not the router's.
    """

    def __init__(self, replicas: list[SimReplica], report_s: float, seed: int = 0, mode: str | None = None,
                 clock=None, cost=None, candidates: int = 8):
        from pdserve.services.pb import common_pb2
        from pdserve.services.registry import WorkerRecord
        from pdserve.services.router.policy import Policy
        from pdserve.services.router.prefix_index import PrefixIndex

        roles = {r.role for r in replicas}
        mode = mode or ("disagg" if {"prefill", "decode"} <= roles else "colocated")
        self.index = PrefixIndex()
        self.clock = clock or (lambda: 0.0)
        self.policy = Policy(mode, self.index, rng=random.Random(seed), clock=self.clock)
        self.rng = random.Random(seed + 1)
        self.replicas = replicas
        self.cost = cost
        self.candidates = candidates
        self.by_id = {r.name: r for r in replicas}
        bs = replicas[0].bm.block_size if replicas else 16
        kvb = getattr(cost, "kv_bytes_per_token", 0) or getattr(getattr(cost, "model", None), "kv_bytes_per_token", 0)
        self.records = {r.name: WorkerRecord(r.name, r.role, f"sim:{r.name}", capacity_blocks=r.bm.num_blocks,
                                             layout=common_pb2.KvLayout(fingerprint=r.bm.fingerprint,
                                                                        block_size=bs, block_bytes=int(kvb * bs)))
                        for r in replicas}
        self.pools = {role: [r.name for r in replicas if r.role == role] for role in ("prefill", "decode", "both")}
        self.report_s = report_s
        self.next_report = -1.0
        self._rates = self._prefill_line()

    def _prefill_line(self) -> tuple[float, float]:
        from pdserve.sim.costmodel import StepShape
        if self.cost is None:
            return 0.0, 0.0
        t1 = self.cost.step_time(StepShape(512, 1, 0, 512, 512 * 513 // 2, 1))
        t2 = self.cost.step_time(StepShape(2048, 1, 0, 2048, 2048 * 2049 // 2, 1))
        slope = (t2 - t1) / 1536
        return (1.0 / slope if slope > 0 else 0.0), max(0.0, t1 - 512 * slope)

    def _report(self, rep: SimReplica, now: float):
        from pdserve.sim.costmodel import StepShape
        ld = rep.load()
        sch = rep.scheduler
        pending = sum(s.num_tokens - s.num_computed_tokens for s in sch.waiting) + \
            sum(s.num_tokens - s.num_computed_tokens for s in sch.running if s.is_prefill)
        ld.pending_prefill_tokens, ld.report_time = pending, now
        if self.cost is not None:
            dec = [s for s in sch.running if not s.is_prefill]
            ctx = sum(s.num_tokens for s in dec)
            n = len(dec)
            step = self.cost.step_time(StepShape(0, 0, n, ctx, ctx, n)) if n else 0.0
            mean = ctx // n if n else 512
            step1 = self.cost.step_time(StepShape(0, 0, n + 1, ctx + mean, ctx + mean, n + 1))
            rate, overhead = self._rates
            ld.prefill_tokens_per_s, ld.prefill_overhead_s, ld.decode_step_s = rate, overhead, step
            ld.decode_step_per_seq_s = max(0.0, step1 - step) if n else 0.0
            bw = getattr(self.cost, "link_bytes_per_s", 0)
            if bw:
                ld.kv_bytes_per_s = bw
            ld.handoff_overhead_s = getattr(self.cost, "handoff_s", 0.0) or 1e-6
        return ld

    def _refresh(self, now: float) -> None:
        for rep in self.replicas:
            rec = self.records[rep.name]
            rec.load = self._report(rep, now)
            rec.updated = now
            ev = rep.bm.events
            while ev:
                e = ev.popleft()
                key = (e.namespace, e.block_hash)
                if e.kind == "stored":
                    self.index.add(rep.name, key)
                else:
                    self.index.remove(rep.name, key)

    def place(self, req: SimRequest, now: float):
        from pdserve.services.router.policy import RouteInput
        if now >= self.next_report:
            self._refresh(now)
            self.next_report = now + self.report_s if self.report_s > 0 else now
        names = []
        for pool in self.pools.values():
            names += pool if len(pool) <= self.candidates else self.rng.sample(pool, self.candidates)
        pl = self.policy.place([self.records[n] for n in names],
                               req=RouteInput(req.rid, req.prompt, len(req.prompt), req.namespace, req.output_len))
        if pl.mode == "colocated":
            return "colocated", self.by_id[pl.both.worker_id], None
        return "disagg", self.by_id[pl.prefill.worker_id], self.by_id[pl.decode.worker_id]


class Cluster:
    def __init__(self, spec: ClusterSpec, cost, placer=None, vocab_size: int = 32000, fingerprint: str = "sim"):
        self.spec = spec
        self.cost = cost
        self.replicas: list[SimReplica] = []
        for role, n in (("prefill", spec.prefill), ("decode", spec.decode), ("both", spec.colocated)):
            for i in range(n):
                self.replicas.append(SimReplica(f"{role}-{i}", role, EngineConfig(**vars(spec.engine)),
                                                spec.num_blocks, cost, fingerprint, spec.max_model_len, vocab_size))
        self.placer = placer or RouterPlacer(self.replicas, spec.report_s, spec.seed, spec.router_mode,
                                             clock=lambda: self.now, cost=cost)
        self.now = 0.0
        self._heap: list = []
        self._tie = itertools.count()
        self.alloc_wait: dict[str, list] = {r.name: [] for r in self.replicas}
        self.requests: list[SimRequest] = []
        self.events_processed = 0
        self.admission = None
        if spec.admission is not None:
            ctx = spec.max_model_len or 1 << 62
            self.admission = SimAdmission(spec.admission, capacity_of(self.replicas), lambda: self.now, self._at, ctx)

    # ---- event machinery --------------------------------------------------------------------------------------
    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._tie), fn, args))

    def _kick(self, rep: SimReplica) -> None:
        if rep.busy:
            return
        step = rep.begin_step(self.now)
        if step is not None:
            out, dt = step
            self._at(self.now + dt, self._end_step, rep, out)

    def _end_step(self, rep: SimReplica, out) -> None:
        for ev in rep.end_step(out, self.now):
            req = ev.req
            if ev.kind == "token":
                req.emits.append(self.now)
            elif ev.kind == "finished":
                self._done(req)
            elif ev.kind == "prefilled":
                dec = self._decode_of[req.rid]
                dec.call(self._try_alloc, dec, rep, req)
                self._kick(dec)
        self._retry_allocs(rep)
        self._kick(rep)

    # ---- disaggregated handoff --------------------------------------------------------------------------------
    def _try_alloc(self, dec: SimReplica, pre: SimReplica, req: SimRequest) -> None:
        cached = dec.add_prefilled(req)
        if cached is None:
            self.alloc_wait[dec.name].append((pre, req))
            return
        xfer = self.cost.transfer_time(max(0, len(req.prompt) - cached))
        req.transfer_s = xfer
        self._at(self.now + xfer, self._commit, dec, pre, req)

    def _retry_allocs(self, dec: SimReplica) -> None:
        waiting, self.alloc_wait[dec.name] = self.alloc_wait[dec.name], []
        for i, (pre, req) in enumerate(waiting):
            self._try_alloc(dec, pre, req)
            if self.alloc_wait[dec.name]:  # still short of blocks: keep FIFO order
                self.alloc_wait[dec.name].extend(waiting[i + 1:])
                return

    def _commit(self, dec: SimReplica, pre: SimReplica, req: SimRequest) -> None:
        pre.call(pre.release_pinned, req.rid)
        dec.call(self._do_commit, dec, req)
        self._kick(dec)

    def _do_commit(self, dec: SimReplica, req: SimRequest) -> None:
        req.emits.append(self.now)
        if dec.commit_prefilled(req):  # output length 1: done at commit
            self._done(req)

    def _done(self, req: SimRequest) -> None:
        """The last token reached the client: the gateway's terminal path releases the reservation."""
        if self.admission is not None:
            self.admission.release(req, finished=req.state == "FINISHED")

    # ---- arrivals ---------------------------------------------------------------------------------------------
    def _arrive(self, req: SimRequest) -> None:
        if self.admission is not None:
            self.admission.admit(req, self._place)
        else:
            self._place(req)

    def _place(self, req: SimRequest) -> None:
        mode, a, b = self.placer.place(req, self.now)
        req.mode = mode
        req.prefill_replica = a.name
        if not a.fits(req) or (b is not None and not b.fits(req)):
            req.state = "REJECTED"
            req.error = "REJECTED:invalid_request"
            self._done(req)
            return
        if mode == "colocated":
            a.call(a.add, req, False)
            req.decode_replica = a.name
            self._kick(a)
        else:
            req.decode_replica = b.name
            self._decode_of[req.rid] = b
            a.call(a.add, req, True)
            self._kick(a)

    def run(self, specs, until: float | None = None) -> list[SimRequest]:
        """Simulate a workload (RequestSpec-like: idx, arrival, prompt, output_len) to completion."""
        self._decode_of: dict[str, SimReplica] = {}
        for s in specs:
            prompt = s.prompt if isinstance(s.prompt, list) else list(range(3, 3 + s.prompt_len))
            req = SimRequest(f"r{s.idx}", s.arrival, prompt, s.output_len, idx=s.idx)
            self.requests.append(req)
            self._at(s.arrival, self._arrive, req)
        heap = self._heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            if until is not None and t > until:
                break
            self.now = t
            fn(*args)
            self.events_processed += 1
        return self.requests

    # ---- results ----------------------------------------------------------------------------------------------
    def records(self) -> list:
        out = []
        for r in self.requests:
            ok = r.state == "FINISHED" and len(r.emits) == r.output_len
            out.append(RequestRecord(idx=r.idx, scheduled=r.arrival, sent=r.arrival, emits=list(r.emits),
                                     prompt_tokens=len(r.prompt), output_tokens=r.output_len if ok else None,
                                     ok=ok, error=None if ok else (r.error or r.state or "unfinished"),
                                     cached_tokens=r.cached_tokens))
        return out

    def summary(self, slo) -> dict:
        s = summarize(self.records(), slo)
        s["cluster"] = {"label": self.spec.label(), "replicas": self.spec.replicas,
                        "busy_fraction": {r.name: r.busy_s / max(self.now, 1e-9) for r in self.replicas[:8]},
                        "steps": sum(r.num_steps for r in self.replicas),
                        "preemptions": sum(r.num_preemptions for r in self.requests),
                        "mean_transfer_s": (sum(r.transfer_s for r in self.requests if r.mode == "disagg")
                                            / max(1, sum(1 for r in self.requests if r.mode == "disagg")))}
        if self.admission is not None:
            s["admission"] = self.admission.summary()
        return s


def simulate(spec: ClusterSpec, cost, specs, slo, **kw) -> dict:
    c = Cluster(spec, cost, **kw)
    c.run(specs)
    return c.summary(slo)
