"""Baseline routing policies for the simulator, with the router `Policy`'s interface
(`place(workers, req=RouteInput) -> Placement`): what cache-aware routing is measured against.
They place on the colocated (`both`) pool only."""
from __future__ import annotations

import random

from pdserve.services.registry import WorkerRecord
from pdserve.services.router.policy import Placement, RouteInput


class RoundRobin:
    def __init__(self):
        self.i = 0

    def place(self, workers: list[WorkerRecord], req: RouteInput) -> Placement:
        ws = sorted((w for w in workers if w.role == "both"), key=lambda w: w.worker_id)
        self.i += 1
        return Placement("colocated", both=ws[self.i % len(ws)], reason="round_robin")


class LeastLoaded:
    """Least outstanding work by the last report plus what it placed since (the classic baseline)."""

    def __init__(self, rng: random.Random, clock):
        self.rng = rng
        self.clock = clock
        self.placed: dict[str, list[tuple[float, int]]] = {}

    def place(self, workers: list[WorkerRecord], req: RouteInput) -> Placement:
        def load(w: WorkerRecord) -> float:
            since = [n for t, n in self.placed.get(w.worker_id, []) if t > w.load.report_time]
            return w.load.pending_prefill_tokens + sum(since) + 100 * w.load.num_running

        ws = [w for w in workers if w.role == "both"]
        best = min(load(w) for w in ws)
        w = self.rng.choice([w for w in ws if load(w) == best])
        self.placed.setdefault(w.worker_id, []).append((self.clock(), req.n_prompt))
        return Placement("colocated", both=w, reason="least_loaded")


class Oracle:
    """Knows every replica's prefix cache exactly (no index, no delay): the longest cached prefix wins, ties go
    to the replica with the fewest sequences waiting or running. The hit ratio any router could reach."""

    def __init__(self, replicas: dict, rng: random.Random):
        self.replicas = replicas  # worker id -> SimReplica
        self.rng = rng

    def place(self, workers: list[WorkerRecord], req: RouteInput) -> Placement:
        ws = [w for w in workers if w.role == "both"]
        hits = {w.worker_id: self.replicas[w.worker_id].cached_prefix(req.prompt_token_ids, req.namespace)
                for w in ws}
        best = max(hits.values())
        cands = [w for w in ws if hits[w.worker_id] == best]
        q = {w.worker_id: self.replicas[w.worker_id].outstanding() for w in cands}
        m = min(q.values())
        return Placement("colocated", both=self.rng.choice([w for w in cands if q[w.worker_id] == m]),
                         reason="oracle")
