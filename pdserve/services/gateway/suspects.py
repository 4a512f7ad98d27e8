"""Workers this gateway just saw die, left out of its placements until the registry has caught up.

A worker that is SIGKILLed (or crashes) stays in the registry until its heartbeat TTL lapses (3 s by default), and
the router keeps placing requests on it until then. In disaggregated mode each such request has its first token
out (from the prefill reply) before the decode pickup finds the worker gone, so every one of them pays a failed
connect and a second placement, and a mid-stream request would spend a migration on a dead worker. The gateway
is the first to know: a call to the worker ended UNAVAILABLE. From then on, for SUSPECT_S, its Route calls name
the worker in `exclude_worker_ids` — unless that leaves the router nothing, in which case it asks again without
them (a suspicion must never turn a servable request into a refusal).

SUSPECT_S covers the default TTL plus the router's view refresh; a worker restarted under the same id within it
(`pdserve up` restarts after 0.5 s, then the engine loads for seconds) is merely skipped for the rest of it.
"""
from __future__ import annotations

import time

SUSPECT_S = 5.0


class Suspects:
    def __init__(self, hold_s: float = SUSPECT_S, clock=time.monotonic):
        self.hold_s = hold_s
        self.clock = clock
        self._until: dict[str, float] = {}  # worker id -> end of its suspicion (clock)

    def add(self, worker_id: str) -> None:
        if worker_id:
            self._until[worker_id] = self.clock() + self.hold_s

    def current(self) -> list[str]:
        """The workers still suspected (expired ones are forgotten here)."""
        now = self.clock()
        for w in [w for w, t in self._until.items() if t <= now]:
            del self._until[w]
        return sorted(self._until)

    def with_(self, exclude: list[str]) -> list[str]:
        """`exclude` plus the current suspects, each once, `exclude`'s order first."""
        return list(dict.fromkeys([*exclude, *self.current()]))
