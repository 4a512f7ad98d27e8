"""The gateway's admission stage (docs/admission.md ③) on the simulator's virtual clock.

Every decision is the real code's: `pdserve.services.admission.prepare` (never-fits 400, output prediction,
the reservation plan), `LocalLedger.reserve_plan` (the ledger rule, run on virtual time), `no_fit` (queue
full -> 503, else the queue deadline), `make_ticket`, and the real `OutputPredictor` fed with FINISHED outputs
as the gateway feeds it. Capacity is `capacity_from_workers` over the replicas' load reports. Only the waiting
is the simulator's: a queued request is retried at every release (the real waiter wakes on the release event;
its 100 ms poll only matters when capacity changes, which it does not in a simulation) and times out at its
queue deadline.

One gateway replica is modelled (its queue bound is per replica); leases never expire (a live gateway renews
them). Not modelled: the deadline limit (`deadline_limit`: it needs the workers' measured rates and the
gateway's calibration, which a simulated run would have to feed back into itself). Requests are n = 1, so DEGRADED cannot happen here; it is counted anyway.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable

from pdserve.services.admission import (
    AdmissionError,
    Capacity,
    OutputPredictor,
    capacity_from_workers,
    make_ticket,
    no_fit,
    plan_for,
    prepare,
)
from pdserve.services.reservations import LocalLedger


@dataclass
class AdmissionSpec:
    """The gateway flags that shape admission (same defaults as `pdserve up`)."""
    max_queue: int = 16              # --admission-queue
    max_queue_wait_s: float = 10.0   # --max-queue-wait
    default_timeout_s: float = 60.0  # --default-timeout: deadline = arrival + this
    overcommit: float = 1.0          # --kv-overcommit
    tenant: str = "default"          # no keys file: every request is tenant `default`


def capacity_of(replicas) -> Capacity | None:
    """What `RegistryCapacity` reads from the registry: roles, layouts and heartbeat loads of the workers."""
    from pdserve.services.pb import common_pb2
    from pdserve.services.registry import WorkerRecord
    recs = [WorkerRecord(r.name, r.role, f"sim:{r.name}", capacity_blocks=r.bm.num_blocks,
                         layout=common_pb2.KvLayout(block_size=r.bm.block_size), load=r.load()) for r in replicas]
    return recs and capacity_from_workers(recs)


class SimAdmission:
    def __init__(self, spec: AdmissionSpec, cap: Capacity | None, clock: Callable[[], float],
                 at: Callable, context_len: int):
        self.spec = spec
        self.cap = cap
        self.clock = clock
        self.at = at                      # at(t, fn, *args): schedule an event
        self.context_len = context_len
        self.ledger = LocalLedger(clock=clock)
        self.lease_s = float("inf")
        self.predictor = OutputPredictor()
        self.queue: list[tuple] = []      # (req, predicted output, on_admit), arrival order
        self.held: dict[str, int] = {}
        self.tickets: dict[str, object] = {}
        self.counts: Counter = Counter()
        self.max_queue_len = 0

    def _try(self, req, pred: int, plan) -> bool:
        k, _, _ = self.ledger.reserve_plan(req.rid, plan, self.cap, self.cap.seqs, self.lease_s)
        if k == 0:
            return False
        self.held[req.rid] = plan.blocks(k)
        self.tickets[req.rid] = make_ticket(req.rid, k, plan.n, plan.blocks(k), pred)
        return True

    def _reject(self, req, e: AdmissionError) -> None:
        req.state = e.state
        req.error = f"{e.state}:{e.code}"
        self.counts[{"capacity": "rejected_capacity", "context_length_exceeded": "rejected_context",
                     "no_workers": "rejected_no_workers"}.get(e.code, "rejected_other")] += 1

    def admit(self, req, on_admit: Callable) -> None:
        """At arrival (tokenize takes no virtual time): admit now, queue, or reject."""
        self.counts["arrived"] += 1
        try:
            pred, plan = prepare(self.predictor, self.spec.tenant, len(req.prompt), req.output_len, 1,
                                 self.context_len, self.cap, cached_tokens=0)
        except AdmissionError as e:
            return self._reject(req, e)
        if self._try(req, pred, plan):
            self.counts["admitted"] += 1
            return on_admit(req)
        try:
            qd = no_fit(len(self.queue), self.spec.max_queue, req.arrival + self.spec.default_timeout_s,
                        self.clock(), self.spec.max_queue_wait_s)
        except AdmissionError as e:
            return self._reject(req, e)
        self.counts["queued"] += 1
        self.queue.append((req, pred, on_admit))
        self.max_queue_len = max(self.max_queue_len, len(self.queue))
        self.at(qd, self._timeout, req)

    def _timeout(self, req) -> None:
        for i, (r, _, _) in enumerate(self.queue):
            if r is req:
                del self.queue[i]
                req.state = "TIMED_OUT"
                req.error = "TIMED_OUT:timeout"
                self.counts["timed_out"] += 1
                return

    def release(self, req, finished: bool) -> None:
        """The gateway's terminal path: give the reservation back, learn the output length, wake the queue."""
        if self.held.pop(req.rid, None) is None:
            return
        self.ledger.release(req.rid)
        if finished:
            self.predictor.observe(self.spec.tenant, len(req.emits))
        admitted, waiting = [], []
        for r, pred, cb in self.queue:  # every waiter retries, in arrival order (a small one may pass a big one)
            if self._try(r, pred, plan_for(len(r.prompt), pred, 1, self.cap.block_size)):
                self.tickets[r.rid].states.insert(0, "QUEUED")
                self.tickets[r.rid].queued_s = self.clock() - r.arrival
                admitted.append((r, cb))
            else:
                waiting.append((r, pred, cb))
        self.queue = waiting  # before placing: a placement can release (and re-enter here)
        for r, cb in admitted:
            self.counts["admitted"] += 1
            cb(r)

    def summary(self) -> dict:
        c = self.counts
        waits = [t.queued_s for t in self.tickets.values() if t.queued_s]
        return {"arrived": c["arrived"], "admitted": c["admitted"], "queued": c["queued"],
                "admitted_after_queue": len(waits), "timed_out": c["timed_out"],
                "rejected_capacity": c["rejected_capacity"], "rejected_context": c["rejected_context"],
                "rejected_other": c["rejected_no_workers"] + c["rejected_other"],
                "degraded": sum(1 for t in self.tickets.values() if t.degraded),
                "max_queue_len": self.max_queue_len,
                "mean_queue_wait_s": sum(waits) / len(waits) if waits else 0.0,
                "capacity": asdict(self.cap) if self.cap else None, "spec": vars(self.spec)}
