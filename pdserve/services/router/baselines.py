"""Baseline placement policies: what cache-aware placement is measured against (the simulator's
`--router-policy`), selectable in a deployment too (`pdserve router --placement`). They place on the colocated
(`both`) pool only and know nothing of prefixes."""
from __future__ import annotations

import random
from typing import Callable

from pdserve.services.registry import WorkerRecord
from pdserve.services.router.placement import NoWorkers, Placement, RouteInput


def colocated(workers: list[WorkerRecord], req: RouteInput, policy: str) -> list[WorkerRecord]:
    """The live `both` workers not excluded for this request (a retry excludes the ones that failed it)."""
    ws = [w for w in workers if w.role == "both" and w.worker_id not in req.exclude]
    if not ws:
        raise NoWorkers(f"no live colocated (both) worker: {policy} places on that pool only")
    return ws


class RoundRobin:
    def __init__(self) -> None:
        self.i = 0

    def place(self, workers: list[WorkerRecord], req: RouteInput) -> Placement:
        ws = sorted(colocated(workers, req, "round-robin"), key=lambda w: w.worker_id)
        self.i += 1
        return Placement("colocated", both=ws[self.i % len(ws)], reason="round_robin")


class LeastLoaded:
    """Least outstanding work by the last report plus what it placed since (the classic baseline)."""

    def __init__(self, rng: random.Random, clock: Callable[[], float]):
        self.rng = rng
        self.clock = clock
        self.placed: dict[str, list[tuple[float, int]]] = {}

    def place(self, workers: list[WorkerRecord], req: RouteInput) -> Placement:
        def load(w: WorkerRecord) -> float:
            since = [n for t, n in self.placed.get(w.worker_id, []) if t > w.load.report_time]
            return w.load.pending_prefill_tokens + sum(since) + 100 * w.load.num_running

        ws = colocated(workers, req, "least-loaded")
        best = min(load(w) for w in ws)
        w = self.rng.choice([w for w in ws if load(w) == best])
        self.placed.setdefault(w.worker_id, []).append((self.clock(), req.n_prompt))
        return Placement("colocated", both=w, reason="least_loaded")
