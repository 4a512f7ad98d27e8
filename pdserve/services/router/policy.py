"""Placement: least-loaded (prefill, decode) pair, or one `both` worker; ties broken at random.

Load comes from worker heartbeats (about once a second), which lag a burst of requests. The policy therefore
adds the placements it made since a worker's last heartbeat, so ten requests arriving together spread out.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from pdserve.services.registry import WorkerRecord


class NoWorkers(RuntimeError):
    """No live worker can take the request (maps to HTTP 503 / gRPC UNAVAILABLE)."""


@dataclass
class Placement:
    mode: str  # disagg | colocated
    prefill: WorkerRecord | None = None
    decode: WorkerRecord | None = None
    both: WorkerRecord | None = None


def load_score(rec: WorkerRecord, recent: int) -> float:
    ld = rec.load or {}
    total = max(int(ld.get("kv_blocks_total", 0) or rec.capacity_blocks or 1), 1)
    return ld.get("num_running", 0) + ld.get("num_waiting", 0) + recent + ld.get("kv_blocks_in_use", 0) / total


class Policy:
    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()
        self._placed: dict[str, list[float]] = {}  # worker id -> times of recent placements

    def _recent(self, rec: WorkerRecord) -> int:
        ts = [t for t in self._placed.get(rec.worker_id, []) if t > rec.updated]
        self._placed[rec.worker_id] = ts
        return len(ts)

    def _pick(self, cands: list[WorkerRecord]) -> WorkerRecord:
        scores = [load_score(c, self._recent(c)) for c in cands]
        best = min(scores)
        choice = self.rng.choice([c for c, s in zip(cands, scores) if s == best])
        self._placed.setdefault(choice.worker_id, []).append(time.time())
        return choice

    def place(self, workers: list[WorkerRecord], exclude: set[str] = frozenset(), prefer: str = "") -> Placement:
        live = [w for w in workers if w.worker_id not in exclude]
        pre = [w for w in live if w.role == "prefill"]
        dec = [w for w in live if w.role == "decode"]
        both = [w for w in live if w.role == "both"]
        if pre and dec and prefer != "colocated":
            return Placement("disagg", prefill=self._pick(pre), decode=self._pick(dec))
        if both:
            return Placement("colocated", both=self._pick(both))
        if pre and dec:
            return Placement("disagg", prefill=self._pick(pre), decode=self._pick(dec))
        raise NoWorkers(f"no live workers (prefill={len(pre)}, decode={len(dec)}, both={len(both)})")
