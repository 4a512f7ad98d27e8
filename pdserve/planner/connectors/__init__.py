"""Who applies a pool size: `local` (the workers of the running `pdserve up` this planner lives in),
`kubernetes` (the prefill and decode Deployments' scale subresource), `registry` (read-only: counts the registry's
live workers; with --dry-run, for a planner that only advises). Each has `name`, `replicas() -> {pool: n}` and
`scale(pool, n)`; scaling down drains (the worker's SIGTERM drain: it leaves the registry, then finishes what it
holds)."""
from __future__ import annotations

from typing import Protocol

POOLS = ("prefill", "decode")


class Connector(Protocol):
    name: str

    def replicas(self) -> dict[str, int]: ...

    def scale(self, pool: str, n: int) -> None: ...
