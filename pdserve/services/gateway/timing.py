"""Per-request emit times -> TTFT / ITL / TPOT / E2E histograms (spec §2.1).

Latency metrics use the gateway as the system boundary: arrival = request received here, emit = a message with
new tokens handed on towards the client (both front doors).
"""
from __future__ import annotations

import time

from pdserve.services.gateway.lifecycle import RequestRecord
from pdserve.services.metrics import gateway as M


class Timing:
    def __init__(self, mode: str = "unknown", rec: RequestRecord | None = None):
        self.rec = rec
        self.arrival = rec.arrival if rec is not None else time.time()
        self.mode = mode
        self.first: float | None = None
        self.last: float | None = None
        self.n = 0

    def emit(self, ntok: int) -> float | None:
        """Record a token-bearing emit; returns its timestamp (the sub-request's stage trace uses the same one)."""
        if ntok <= 0:
            return None
        now = time.time()
        if self.first is None:
            self.first = now
            M.TTFT.labels(self.mode).observe(now - self.arrival)
        else:
            M.ITL.labels(self.mode).observe(now - self.last)
        self.last = now
        self.n += ntok
        if self.rec is not None:
            self.rec.first_emit, self.rec.last_emit = self.first, now
        return now

    def done(self) -> None:
        if self.last is not None:
            M.E2E.labels(self.mode).observe(self.last - self.arrival)
            if self.n >= 2:
                M.TPOT.labels(self.mode).observe((self.last - self.first) / (self.n - 1))
