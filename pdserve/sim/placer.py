"""The router in the simulator: a placement policy from the router's registry (policy_registry.py: the real
cache-aware `Policy`, a baseline, or one registered by the caller) placing requests on simulated replicas.

`RouterPlacer` holds one `WorkerRecord` per replica whose load is rebuilt every `report_s` of virtual time from
the replica's real scheduler / block-manager state (the workers' heartbeat), with the rates a worker would have
measured taken from the cost model; the policy's clock is virtual time, so it ages reports and in-flight
placements as in a deployment. The prefix index is fed with the replicas' real BlockManager stored/evicted
events through an `index_feed` (in-process, or through Redis as the real router does), `event_delay_s` after
the step that produced them. Block bytes in the records' layout come from the cost model's KV bytes per token.

With pools larger than `candidates`, each decision sees a random sample of `candidates` workers per pool
(power-of-k choices): the policy scores every (prefill, decode) pair, which is O(P x D) per request and too slow
at 64 x 64 in a simulation; this sampling is the simulator's, not the router's.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.services.pb import common_pb2
from pdserve.services.registry import WorkerRecord
from pdserve.services.router import policy_registry
from pdserve.services.router.placement import PolicyContext, RouteInput
from pdserve.sim import baselines  # noqa: F401 (registers the sim-only `oracle`)
from pdserve.sim.costmodel import StepShape
from pdserve.sim.executor import SimReplica, SimRequest
from pdserve.sim.index_feed import DirectIndex, RedisIndex


@dataclass
class RouterSpec:
    policy: str = "cache-aware"       # a name in policy_registry: cache-aware | round-robin | least-loaded | oracle
    mode: str | None = None           # cache-aware's mode; default: disagg with P/D pools, colocated otherwise
    index: str = "direct"             # direct (in-process PrefixIndex) | redis (the real publisher / IndexSync)
    redis_url: str = "redis://127.0.0.1:6379/0"
    event_delay_s: float = 0.1        # block events reach the index this long after their step
    candidates: int = 8               # workers per pool each decision sees (large pools)
    track_best_hit: bool = False      # record, per decision, the longest prefix any replica holds

    def validate(self) -> None:
        if self.policy not in policy_registry.names(sim=True):
            raise ValueError(f"router policy must be one of {', '.join(policy_registry.names(sim=True))}, "
                             f"not {self.policy!r}")
        if self.index not in ("direct", "redis"):
            raise ValueError(f"router index must be direct or redis, not {self.index!r}")


class RouterPlacer:
    def __init__(self, replicas: list[SimReplica], spec: RouterSpec, report_s: float, seed: int = 0,
                 clock=None, cost=None):
        spec.validate()
        self.spec = spec
        self.clock = clock or (lambda: 0.0)
        self.replicas = replicas
        self.by_id = {r.name: r for r in replicas}
        self.feed = RedisIndex(spec.redis_url, [r.name for r in replicas], spec.event_delay_s) \
            if spec.index == "redis" else DirectIndex(spec.event_delay_s)
        self.policy = self._make_policy(spec, seed)
        self.rng = random.Random(seed + 1)
        self.cost = cost
        bs = replicas[0].bm.block_size if replicas else 16
        kvb = getattr(cost, "kv_bytes_per_token", 0) or getattr(getattr(cost, "model", None), "kv_bytes_per_token", 0)
        self.records = {r.name: WorkerRecord(r.name, r.role, f"sim:{r.name}", capacity_blocks=r.bm.num_blocks,
                                             layout=common_pb2.KvLayout(fingerprint=r.bm.fingerprint,
                                                                        block_size=bs, block_bytes=int(kvb * bs)))
                        for r in replicas}
        self.pools = {role: [r.name for r in replicas if r.role == role] for role in ("prefill", "decode", "both")}
        self.report_s = report_s
        self.next_report = -1.0
        self._rates = {r.name: self._prefill_line(r.cost) for r in replicas} if cost is not None else {}

    def _make_policy(self, spec: RouterSpec, seed: int):
        roles = {r.role for r in self.replicas}
        mode = spec.mode or ("disagg" if {"prefill", "decode"} <= roles else "colocated")
        ctx = PolicyContext(mode, self.feed.index, rng=random.Random(seed), clock=self.clock, replicas=self.by_id)
        return policy_registry.create(spec.policy, ctx)

    @property
    def index(self):
        return self.feed.index

    def restart_router(self, seed: int) -> None:
        """Replace the router process: a new policy whose index is rebuilt from Redis (index = redis only)."""
        if not isinstance(self.feed, RedisIndex):
            raise ValueError("a router restart rebuilds its index from Redis: needs index='redis'")
        self.feed.restart_router()
        self.policy = self._make_policy(self.spec, seed)

    def close(self) -> None:
        self.feed.close()

    # ---- what the router hears from the workers ---------------------------------------------------------------
    def kv_events(self, rep: SimReplica, now: float) -> None:
        """After each of `rep`'s steps: its block events go out (and reach the index `event_delay_s` later)."""
        ev = rep.bm.events
        if ev:
            self.feed.publish(rep.name, list(ev), now)
            ev.clear()

    @staticmethod
    def _prefill_line(cost) -> tuple[float, float]:
        t1 = cost.step_time(StepShape.prefill(512))
        t2 = cost.step_time(StepShape.prefill(2048))
        slope = (t2 - t1) / 1536
        return (1.0 / slope if slope > 0 else 0.0), max(0.0, t1 - 512 * slope)

    def _report(self, rep: SimReplica, now: float) -> common_pb2.LoadReport:
        ld = rep.load()
        sch = rep.scheduler
        pending = sum(s.num_tokens - s.num_computed_tokens for s in sch.waiting) + \
            sum(s.num_tokens - s.num_computed_tokens for s in sch.running if s.is_prefill)
        ld.pending_prefill_tokens, ld.report_time = pending, now
        if self.cost is not None:  # each replica's own cost model (pools may differ: ClusterSpec.pools)
            cost = rep.cost
            dec = [s for s in sch.running if not s.is_prefill]
            ctx = sum(s.num_tokens for s in dec)
            n = len(dec)
            step = cost.step_time(StepShape.decode(n, ctx)) if n else 0.0
            mean = ctx // n if n else 512
            step1 = cost.step_time(StepShape.decode(n + 1, ctx + mean))
            rate, overhead = self._rates[rep.name]
            ld.prefill_tokens_per_s, ld.prefill_overhead_s, ld.decode_step_s = rate, overhead, step
            ld.decode_step_per_seq_s = max(0.0, step1 - step) if n else 0.0
            bw = getattr(cost, "link_bytes_per_s", 0)
            if bw:
                ld.kv_bytes_per_s = bw
            ld.handoff_overhead_s = getattr(cost, "handoff_s", 0.0) or 1e-6
        return ld

    def _refresh(self, now: float) -> None:
        for rep in self.replicas:
            rec = self.records[rep.name]
            rec.load = self._report(rep, now)
            rec.updated = now

    # ---- role switches (sim/role_switch.py) -------------------------------------------------------------------
    def withdraw(self, rep: SimReplica) -> None:
        """`rep` leaves every pool (its record says `switching`): no decision picks it until `enroll`."""
        for pool in self.pools.values():
            if rep.name in pool:
                pool.remove(rep.name)
        self.records[rep.name].role = "switching"

    def enroll(self, rep: SimReplica, role: str) -> None:
        """`rep` serves in `role`: its record says so at once (the switch registers the new role immediately)."""
        self.records[rep.name].role = role
        self.pools[role].append(rep.name)

    # ---- a decision -------------------------------------------------------------------------------------------
    def place(self, req: SimRequest, now: float, prefer: str = "", prompt: list[int] | None = None,
              max_tokens: int | None = None):
        """`prefer`, `prompt`, `max_tokens`: a migrated request's placement (prefer `local`: prompt + the tokens
        sent, the rest of its output), as the gateway asks for it."""
        if now >= self.next_report:
            self._refresh(now)
            self.next_report = now + self.report_s if self.report_s > 0 else now
        self.feed.sync(now)
        if self.spec.track_best_hit:
            req.best_cached_tokens = max((r.cached_prefix(req.prompt, req.namespace) for r in self.replicas
                                          if r.role in ("both", "prefill")), default=0)
        names = []
        for pool in self.pools.values():
            names += pool if len(pool) <= self.spec.candidates else self.rng.sample(pool, self.spec.candidates)
        prompt = req.prompt if prompt is None else prompt
        pl = self.policy.place([self.records[n] for n in names],
                               req=RouteInput(req.rid, prompt, len(prompt), req.namespace,
                                              req.output_len if max_tokens is None else max_tokens, prefer=prefer))
        if pl.mode == "colocated":
            return "colocated", self.by_id[pl.both.worker_id], None
        return "disagg", self.by_id[pl.prefill.worker_id], self.by_id[pl.decode.worker_id]
