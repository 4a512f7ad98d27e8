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
Placement: `RouterPlacer` (placer.py) runs a placement policy selected by name from the router's registry
(`RouterSpec.policy`: the real cache-aware `Policy`, round-robin, least-loaded, oracle, or one registered) - over
`WorkerRecord`s that carry the replicas' load, refreshed every `report_s` of virtual time (the workers'
heartbeat), so the policy sees load as stale as it does in a deployment; the prefix index follows the replicas' block events in-process or through Redis
(`RouterSpec.index`).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pdserve.engine.config import EngineConfig
from pdserve.sim.admission import AdmissionSpec, SimAdmission, capacity_of
from pdserve.sim.executor import SimReplica, SimRequest
from pdserve.sim.placer import RouterPlacer, RouterSpec
from pdserve.sim.workload import ClientRecord, summarize


@dataclass(frozen=True)
class PoolCost:
    """One pool's replicas: their cost model, KV blocks each and GPUs each (the tensor-parallel degree)."""
    cost: object
    num_blocks: int
    tp: int = 1


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
    router: RouterSpec = field(default_factory=RouterSpec)  # policy (or a baseline), index feed
    # the gateway's admission stage (on in every `pdserve up`); None = off (e.g. against a bare in-process Engine)
    admission: AdmissionSpec | None = field(default_factory=AdmissionSpec)
    # a pool's own step costs and KV blocks (e.g. prefill at TP 1 and decode at TP 4): role -> PoolCost; a role
    # not named uses the cluster's cost model and num_blocks
    pools: dict = field(default_factory=dict)

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


class Cluster:
    def __init__(self, spec: ClusterSpec, cost, vocab_size: int = 32000, fingerprint: str = "sim"):
        self.spec = spec
        self.cost = cost
        self.replicas: list[SimReplica] = []
        for role, n in (("prefill", spec.prefill), ("decode", spec.decode), ("both", spec.colocated)):
            pool = spec.pools.get(role)
            rcost, blocks = (pool.cost, pool.num_blocks) if pool else (cost, spec.num_blocks)
            for i in range(n):
                self.replicas.append(SimReplica(f"{role}-{i}", role, EngineConfig(**vars(spec.engine)),
                                                blocks, rcost, fingerprint, spec.max_model_len, vocab_size))
        self.now = 0.0
        self.placer = RouterPlacer(self.replicas, spec.router, spec.report_s, spec.seed, clock=lambda: self.now,
                                   cost=cost)
        self._heap: list = []
        self._tie = itertools.count()
        self.alloc_wait: dict[str, list] = {r.name: [] for r in self.replicas}
        self.requests: list[SimRequest] = []
        self.inbound: dict[str, int] = {}  # decode replica -> requests placed on it, not yet committed there
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
        events = rep.end_step(out, self.now)
        self.placer.kv_events(rep, self.now)
        for ev in events:
            req = ev.req
            if ev.kind == "token":
                req.emits.append(self.now)
            elif ev.kind == "finished":
                self._done(req)
            elif ev.kind == "prefilled":
                req.prefilled_at = self.now
                dec = self._decode_of[req.rid]
                if self.placer.records[dec.name].role != "decode":
                    dec = self._redirect(req, dec)
                    if dec is None:
                        rep.call(rep.release_pinned, req.rid)  # the gateway releases what nobody will pull
                        continue
                dec.call(self._try_alloc, dec, rep, req)
                self._kick(dec)
        self._retry_allocs(rep)
        self._kick(rep)

    # ---- disaggregated handoff --------------------------------------------------------------------------------
    def _redirect(self, req: SimRequest, was: SimReplica) -> SimReplica | None:
        """The decode replica placed for `req` left the decode pool while its prompt prefilled (a role switch):
        the real worker refuses the pickup (UNAVAILABLE, role switch) and the gateway asks the router for another
        decode worker to pull the still-pinned KV. None: there is none (the request fails, as the gateway's
        `no decode worker left`)."""
        self.inbound[was.name] -= 1
        mode, _, dec = self.placer.place(req, self.now, prefer="disagg")
        if mode != "disagg":
            req.state, req.error = "FAILED", "FAILED:no decode worker left"
            self._done(req)
            return None
        self._decode_of[req.rid] = dec
        req.decode_replica = dec.name
        self.inbound[dec.name] = self.inbound.get(dec.name, 0) + 1
        return dec

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
        self.inbound[dec.name] -= 1
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
        a.placed += 1
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
            self.inbound[b.name] = self.inbound.get(b.name, 0) + 1
            a.call(a.add, req, True)
            self._kick(a)

    def run(self, specs, until: float | None = None) -> list[SimRequest]:
        """Simulate a workload (RequestSpec-like: idx, arrival, prompt, output_len) to completion."""
        self._decode_of: dict[str, SimReplica] = {}
        for s in specs:
            prompt = s.prompt if isinstance(s.prompt, list) else list(range(3, 3 + s.prompt_len))
            req = SimRequest(f"r{s.idx}", s.arrival, prompt, s.output_len, idx=s.idx,
                             namespace=getattr(s, "namespace", ""))
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

    def close(self) -> None:
        """Release what the router holds outside the process (the Redis index's keys and client)."""
        self.placer.close()

    # ---- results ----------------------------------------------------------------------------------------------
    def prefix_hit_ratio(self, requests: list[SimRequest] | None = None) -> float:
        """Prompt tokens served from a prefix cache / prompt tokens, over finished requests."""
        done = [r for r in (self.requests if requests is None else requests) if r.state == "FINISHED"]
        return sum(r.cached_tokens for r in done) / max(1, sum(len(r.prompt) for r in done))

    def best_hit_ratio(self, requests: list[SimRequest] | None = None) -> float:
        """The same with, per decision, the longest prefix any replica held (`RouterSpec.track_best_hit`)."""
        done = [r for r in (self.requests if requests is None else requests) if r.state == "FINISHED"]
        return sum(r.best_cached_tokens for r in done) / max(1, sum(len(r.prompt) for r in done))

    def records(self) -> list:
        out = []
        for r in self.requests:
            ok = r.state == "FINISHED" and len(r.emits) == r.output_len
            out.append(ClientRecord(idx=r.idx, scheduled=r.arrival, sent=r.arrival, emits=list(r.emits),
                                     prompt_tokens=len(r.prompt), output_tokens=r.output_len if ok else None,
                                     ok=ok, error=None if ok else (r.error or r.state or "unfinished"),
                                     cached_tokens=r.cached_tokens))
        return out

    def decode_wait_p90(self) -> float:
        """p90 over disaggregated requests of the time from the end of their prefill to their first token less the
        transfer: waiting for the decode side's blocks. Large when the decode pool is full (its KV or sequence
        slots), which shows as TTFT, not TPOT."""
        waits = sorted(r.emits[0] - r.prefilled_at - r.transfer_s for r in self.requests
                       if r.prefilled_at is not None and r.emits)
        return waits[min(len(waits) - 1, int(0.9 * len(waits)))] if waits else 0.0

    def slo_misses(self, slo) -> dict:
        """Requests that missed the SLO, by the part that missed: TTFT spent mostly waiting for the decode side's
        blocks (over half the TTFT SLO), TTFT otherwise (prefill queue and compute), TPOT. A request can count
        twice; `kv_capacity`: turned away by admission for want of KV, at once or after queueing (in a disaggregated
        cluster the decode pool's KV: sim/admission.py). What the plan reads to choose the pool to grow."""
        out = {"ttft_decode_wait": 0, "ttft_prefill": 0, "tpot": 0, "kv_capacity": 0}
        for r in self.requests:
            if not r.emits:
                out["kv_capacity"] += r.error in ("REJECTED:capacity", "TIMED_OUT:timeout")  # 503, or queued too long
                continue
            if slo.ttft is not None and r.emits[0] - r.arrival > slo.ttft:
                wait = r.emits[0] - r.prefilled_at - r.transfer_s if r.prefilled_at is not None else 0.0
                out["ttft_decode_wait" if wait > slo.ttft / 2 else "ttft_prefill"] += 1
            if slo.tpot is not None and len(r.emits) > 1 and \
                    (r.emits[-1] - r.emits[0]) / (len(r.emits) - 1) > slo.tpot:
                out["tpot"] += 1
        return out

    def summary(self, slo) -> dict:
        s = summarize(self.records(), slo)
        s["cluster"] = {"label": self.spec.label(), "replicas": self.spec.replicas,
                        "busy_fraction": {r.name: r.busy_s / max(self.now, 1e-9) for r in self.replicas[:8]},
                        "steps": sum(r.num_steps for r in self.replicas),
                        "prefix_hit_ratio": self.prefix_hit_ratio(),
                        "decode_wait_p90_s": self.decode_wait_p90(),
                        "slo_misses": self.slo_misses(slo),
                        "preemptions": sum(r.num_preemptions for r in self.requests),
                        "mean_transfer_s": (sum(r.transfer_s for r in self.requests if r.mode == "disagg")
                                            / max(1, sum(1 for r in self.requests if r.mode == "disagg")))}
        if self.admission is not None:
            s["admission"] = self.admission.summary()
        return s


def simulate(spec: ClusterSpec, cost, specs, slo, **kw) -> dict:
    c = Cluster(spec, cost, **kw)
    try:
        c.run(specs)
        return c.summary(slo)
    finally:
        c.close()
