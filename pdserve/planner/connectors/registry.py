"""Read-only connector: the pools are what the registry holds live (for `pdserve planner --dry-run` anywhere)."""
from __future__ import annotations

from pdserve.planner.connectors import POOLS


class RegistryConnector:
    name = "registry"

    def __init__(self):
        self.seen: dict[str, int] = dict.fromkeys(POOLS, 0)

    def observe(self, workers) -> None:
        """The loop hands over each interval's live records (WorkerRecord)."""
        self.seen = {pool: sum(1 for w in workers if w.role == pool) for pool in POOLS}

    def replicas(self) -> dict[str, int]:
        return dict(self.seen)

    def scale(self, pool: str, n: int) -> None:
        raise RuntimeError("the registry connector cannot scale; run the planner with --dry-run")
