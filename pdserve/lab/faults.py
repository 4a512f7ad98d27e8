"""Faults on the links of a running lab (cluster.py), each a coroutine that injects the fault, holds it, and puts the
links back as they were before returning: the link faults of the fault matrix (pdserve/bench/chaos_lab.py). Each
returns what the fault met (pinned KV at a cut, streams on a cut host, segments retransmitted, packets held): a
row whose fault met no traffic proves nothing, and the note says so.

The `ip`/`tc`/`nft` commands behind them block for tens of milliseconds (a `Network.hold` for its whole spike), so
they run in a thread: the load generator sharing the event loop must not stall with them, or its clients would
record the harness's own pause as the deployment's. Putting the links back runs in `finally`, in a thread the
caller's cancellation cannot stop (`_heal`): a cancelled case still heals the network, and each undo is idempotent
(a link set up twice, a cut removed twice).
"""
from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import replace

from pdserve.lab.cluster import LabCluster
from pdserve.lab.netns import Host
from pdserve.services.leftovers import PINNED, metric_sum, scrape


def hosts_of(c: LabCluster, role: str) -> list[Host]:
    return [h for name, h in c.workers.items() if name.split("-")[0] == role]


def _metric(c: LabCluster, host: str, name: str) -> float:
    try:
        return metric_sum(scrape(c.metrics_url(host), timeout=2), name)
    except Exception:  # noqa: BLE001 - an unreadable host counts as holding nothing
        return -1.0


def retransmitted(c: LabCluster, hosts: list[Host] | None = None) -> int:
    """TCP segments `hosts` (default: every host of the lab) retransmitted so far (each namespace's
    /proc/net/snmp)."""
    total = 0
    for h in hosts if hosts is not None else list(c.net.hosts.values()):
        rows = [ln.split() for ln in subprocess.run([*h.exec_prefix(), "cat", "/proc/net/snmp"], capture_output=True,
                                                    text=True, check=True).stdout.splitlines() if ln.startswith("Tcp:")]
        total += int(rows[1][rows[0].index("RetransSegs")])
    return total


async def _heal(undo) -> None:
    """Run `undo` to its end even if the caller is cancelled meanwhile (the thread finishes; asyncio.run waits
    for it at exit)."""
    await asyncio.shield(asyncio.to_thread(undo))


async def _until(pred, timeout: float, every: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if await asyncio.to_thread(pred):
            return True
        await asyncio.sleep(every)
    return False


async def link_down_mid_transfer(c: LabCluster, seconds: float = 3.0, wait_s: float = 2.0) -> str:
    """Every prefill host's link down while KV waits on one for its pull (blocks pinned under a lease: a pull is
    due or under way; after `wait_s` s without, down anyway), back `seconds` s later."""
    prefills = hosts_of(c, "prefill")
    pinned = 0.0

    def seen() -> bool:
        nonlocal pinned
        pinned = sum(max(0.0, _metric(c, h.name, PINNED)) for h in prefills)
        return pinned > 0

    met = await _until(seen, wait_s, every=0.01)
    note = (f"{pinned:.0f} KV blocks pinned for pulls on the prefill hosts at the cut" if met else
            f"no KV pinned on a prefill host within {wait_s} s: cut anyway")
    try:
        for h in prefills:
            await asyncio.to_thread(c.net.set_down, h)
        await asyncio.sleep(seconds)
    finally:
        await _heal(lambda: [c.net.set_down(h, down=False) for h in prefills])
    return note


async def loss(c: LabCluster, pct: float = 5.0, seconds: float = 4.0) -> str:
    """`pct` percent of the packets dropped each way on every host's link (workers, gateway, router, Redis), their
    rate caps kept, for `seconds` s."""
    saved = {h.name: h.link for h in c.net.hosts.values()}
    before = await asyncio.to_thread(retransmitted, c)
    try:
        for h in c.net.hosts.values():
            await asyncio.to_thread(c.net.shape, h, replace(saved[h.name], loss_pct=pct))
        await asyncio.sleep(seconds)
    finally:
        await _heal(lambda: [c.net.shape(h, saved[h.name]) for h in c.net.hosts.values()])
    return f"{await asyncio.to_thread(retransmitted, c) - before} TCP segments retransmitted by the hosts meanwhile"


async def delay_spike(c: LabCluster, seconds: float = 0.2) -> str:
    """Every worker host's link holds its packets for `seconds` s, then releases them (`Network.hold`: the kernel
    here has no netem; the worker links must be rate-capped). The gateway, router and Redis links are unshaped
    and so not held; every request still crosses a held link (each is served by worker hosts)."""
    held = await asyncio.to_thread(c.net.hold, list(c.workers.values()), seconds)
    return (f"each worker link end held {held.at_least_s:.2f}-{held.at_most_s:.2f} s, {held.queued_packets} "
            "packets queued ~0.1 s before the release")


async def standing_delay(c: LabCluster, delay_ms: float = 200.0, seconds: float = 4.0) -> str:
    """Every worker host's link adds `delay_ms` to each packet, both ways (netem, or lab/delay.py where the kernel
    has none), its rate cap kept, for `seconds` s: a KV pull from one worker host to another then waits 4 x
    `delay_ms` per round trip, every streamed token 2 x `delay_ms` more."""
    hosts = list(c.workers.values())
    saved = {h.name: h.link for h in hosts}
    try:
        for h in hosts:
            await asyncio.to_thread(c.net.shape, h, replace(saved[h.name], delay_ms=delay_ms))
        await asyncio.sleep(seconds)
    finally:
        await _heal(lambda: [c.net.shape(h, saved[h.name]) for h in hosts])
    return f"{len(hosts)} worker links delayed {delay_ms:g} ms each way for {seconds:g} s"


async def asymmetric_partition(c: LabCluster, seconds: float = 5.0) -> str:
    """Every packet a decode host sends to a prefill host dropped, prefill -> decode untouched, for `seconds` s."""
    pairs = [(d, p) for d in hosts_of(c, "decode") for p in hosts_of(c, "prefill")]
    try:
        for d, p in pairs:
            await asyncio.to_thread(c.net.cut, d, p)
        await asyncio.sleep(seconds)
    finally:
        await _heal(lambda: [c.net.cut(d, p, cut=False) for d, p in pairs])
    return f"{len(pairs)} decode -> prefill directions cut for {seconds:g} s"


async def router_redis_cut(c: LabCluster, seconds: float = 6.0) -> str:
    """The router's host and Redis's cannot reach each other (both ways) for `seconds` s; everyone else can."""
    router, redis = c.net.hosts["router"], c.net.hosts["redis"]
    try:
        await asyncio.to_thread(c.net.cut, router, redis)
        await asyncio.to_thread(c.net.cut, redis, router)
        await asyncio.sleep(seconds)
    finally:
        await _heal(lambda: (c.net.cut(router, redis, cut=False), c.net.cut(redis, router, cut=False)))
    return f"router <-> Redis cut both ways for {seconds:g} s"


async def decode_host_cut(c: LabCluster, seconds: float = 10.0) -> str:
    """The decode host running the most streams cut off from everything (its link down), back `seconds` s
    later."""
    decodes = hosts_of(c, "decode")
    running = await asyncio.to_thread(lambda: {h.name: _metric(c, h.name, "pdserve_num_running") for h in decodes})
    h = next(d for d in decodes if d.name == max(running, key=running.get))
    try:
        await asyncio.to_thread(c.net.set_down, h)
        await asyncio.sleep(seconds)
    finally:
        await _heal(lambda: c.net.set_down(h, down=False))
    return f"{h.name} cut off for {seconds:g} s while running {running[h.name]:.0f} streams"
