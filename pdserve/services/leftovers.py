"""What a fault left behind in a deployment: KV blocks in use and pinned (under a lease) on every worker, and KV
reservations in Redis. Read the same way for a one-host `pdserve up` (bench/chaos.py) and for the emulated hosts
of the lab (pdserve/bench/chaos_lab.py, tests/e2e/test_lab.py): each worker's /metrics and the deployment's Redis.
"""
from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

BLOCKS = "pdserve_kv_blocks_in_use"
PINNED = "pdserve_kv_blocks_pinned"   # prefill-side blocks held under a lease for a pull


def scrape(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of `name` on a /metrics page (any labels)."""
    return sum(float(m.group(2)) for m in re.finditer(rf"^{name}(\{{[^}}]*\}})?\s+(\S+)$", text, re.M))


def reservation_keys(served: str) -> tuple[str, str]:
    """The ledger's Redis keys (services/reservations.py): request id -> lease expiry, request id -> blocks."""
    return f"pdserve:{served}:reservations", f"pdserve:{served}:reservation_blocks"


@dataclass(frozen=True)
class Leftovers:
    """None: could not be read (a worker's /metrics or Redis did not answer)."""

    blocks: int | None
    pinned: int | None
    reservations: int | None
    per_worker: dict = field(default_factory=dict)  # worker -> (blocks, pinned), for the message of a failure

    @property
    def clean(self) -> bool:
        return self.blocks == 0 and self.pinned == 0 and self.reservations == 0


def read_leftovers(workers: dict[str, str], redis_client: Callable[[], object], served: str) -> Leftovers:
    """`workers`: name -> its /metrics URL; `redis_client()`: a synchronous redis-py client of the deployment's
    Redis (called once per read: a fault may have broken the previous connection)."""
    blocks: int | None = 0
    pinned: int | None = 0
    per: dict[str, tuple[int, int]] = {}
    for name, url in workers.items():
        try:
            text = scrape(url)
        except Exception:  # noqa: BLE001 - unreadable is reported as None, not raised
            blocks = pinned = None
            break
        per[name] = (int(metric_sum(text, BLOCKS)), int(metric_sum(text, PINNED)))
        blocks += per[name][0]
        pinned += per[name][1]
    try:
        r = redis_client()
        zkey, hkey = reservation_keys(served)
        reservations: int | None = r.zcard(zkey) + r.hlen(hkey)
    except Exception:  # noqa: BLE001
        reservations = None
    return Leftovers(blocks, pinned, reservations, per)


def settle(read: Callable[[], Leftovers], timeout: float, every: float = 0.1) -> tuple[Leftovers, float | None]:
    """Read until everything is released or `timeout` s passed: the last reading, and the seconds it took to
    read clean (None: never did). Cleanup after a fault is asynchronous (a cancelled stream's release, a lease's
    expiry), so one reading right after the load is not the answer."""
    t0 = time.monotonic()
    left = read()
    while not left.clean and time.monotonic() - t0 < timeout:
        time.sleep(every)
        left = read()
    return left, (round(time.monotonic() - t0, 2) if left.clean else None)
