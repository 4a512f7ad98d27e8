"""The link faults of the fault matrix: the same harness (chaos.py's open-loop load, accounting and `run_case`)
against a deployment on the lab's emulated hosts (pdserve/lab), where every process talks over a link of its own.

`python bench/chaos.py --lab` runs them (table in docs/reliability.md); tests/e2e/test_lab.py runs one through
`run_case` on its own lab. What a case leaves behind is read as for the one-host cases: each worker host's
/metrics and the lab's Redis (reservations), from the client host over the bridge.
"""
from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Awaitable, Callable

from pdserve.bench.chaos import gateway_migrations
from pdserve.lab import faults
from pdserve.lab.cluster import LabCluster
from pdserve.services.leftovers import Leftovers

# case -> (fault, its default length in s; None: the fault has none of its own)
LAB_FAULTS: dict[str, tuple[Callable[..., Awaitable[str]], float | None]] = {
    "link-down-mid-transfer": (faults.link_down_mid_transfer, 3.0),
    "loss-5pct": (faults.loss, 4.0),
    "delay-spike-200ms": (faults.delay_spike, None),
    "delay-200ms-standing": (faults.standing_delay, 4.0),
    "asymmetric-partition": (faults.asymmetric_partition, 5.0),
    "router-redis-cut": (faults.router_redis_cut, 6.0),
    "decode-host-cut-10s": (faults.decode_host_cut, 10.0),
}
LAB_CASES = tuple(LAB_FAULTS)


class LabChaosDeployment:
    """chaos.Deployment over a started LabCluster (not owned: its owner closes it). `fault_s` shortens (or
    lengthens) every fault that has a length (a test's small budget); None: each case's own. The heartbeat TTL is
    the cluster's own (its spec), never a second copy that could disagree with what the processes run."""

    def __init__(self, cluster: LabCluster, fault_s: float | None = None):
        self.c = cluster
        self.served = cluster.served
        self.ttl = cluster.spec.heartbeat_ttl
        self.fault_s = fault_s

    @property
    def bases(self) -> list[str]:
        return [self.c.base_url]  # the lab runs one gateway

    def healthy(self) -> bool:
        want = {"prefill": len(faults.hosts_of(self.c, "prefill")), "decode": len(faults.hosts_of(self.c, "decode"))}
        try:
            with urllib.request.urlopen(self.c.base_url + "/health", timeout=3) as r:
                seen = json.loads(r.read()).get("workers", {})
        except Exception:  # noqa: BLE001
            return False
        return all(seen.get(role, 0) >= n for role, n in want.items()) and all(
            ch.running for ch in self.c.sup.children.values())

    def wait_ready(self, timeout: float = 90.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.c.sup.poll()  # restarts whatever exited (none of these faults kills a process; one may still die)
            if self.healthy():
                return True
            time.sleep(0.25)
        return False

    def fault(self, case: str) -> Callable[[], Awaitable[str | None]]:
        try:
            inject, length = LAB_FAULTS[case]
        except KeyError:
            raise ValueError(f"unknown lab case {case} (one of {', '.join(LAB_CASES)})") from None
        kw = {} if length is None else {"seconds": self.fault_s if self.fault_s is not None else length}
        return lambda: inject(self.c, **kw)

    def leftovers(self) -> Leftovers:
        return self.c.leftovers()

    def migrations(self) -> float:
        return gateway_migrations([self.c.metrics_url("gateway")])

    def log_lines(self) -> list[str]:
        return list(self.c.lines)

    def after_case(self, case: str) -> None:
        """Nothing to restore: each fault puts its links back itself."""
