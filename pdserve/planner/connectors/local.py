"""Scale the workers of the running `pdserve up` this planner lives in (`pdserve up --planner`).

The planner runs as a thread of the `up` process, which owns the worker children: growing a pool calls the
`start_worker(role)` function `up` hands over (the same command line `up` starts its first workers with); shrinking
sends the pool's newest worker SIGTERM, i.e. the worker's own drain (it leaves the registry so nothing new is routed
to it, finishes its in-flight requests and pinned KV leases, then exits), and reaps it in the background (SIGKILL
after its drain timeout + a grace). A draining worker no longer counts as a replica. `up`'s process table is
`Deployment.procs`; a reaped worker is removed from it by rebinding the list, so `up`'s own loop, iterating the old
list in another thread, never sees it change under it.

The hooks in services/up.py are `start_in_up` (after the deployment is ready) and `LocalPlanner.stop` (before `up`
stops its children): everything else stays here, to move onto a process supervisor unchanged.
"""
from __future__ import annotations

import logging
import signal
import subprocess
import threading
from typing import Callable

from pdserve.planner.connectors import POOLS

log = logging.getLogger("pdserve.planner")


class LocalConnector:
    name = "local"

    def __init__(self, deployment, start_worker: Callable[[str], subprocess.Popen], drain_timeout_s: float = 30.0,
                 state: dict | None = None):
        """`state`: `up`'s PDSERVE_UP record; rewritten (status.remember_local) at every change with the live
        processes and the draining ones, for `pdserve status`."""
        self.d = deployment
        self.start_worker = start_worker
        self.drain_timeout_s = drain_timeout_s
        self.state = state
        self.draining: set[int] = set()  # pids sent SIGTERM by us, until reaped
        self.reapers: list[threading.Thread] = []
        self.lock = threading.Lock()

    def _live(self, pool: str) -> list[tuple[str, subprocess.Popen, dict]]:
        return [(n, p, info) for n, p, info in list(self.d.procs)
                if info.get("role") == pool and p.poll() is None and p.pid not in self.draining]

    def replicas(self) -> dict[str, int]:
        return {pool: len(self._live(pool)) for pool in POOLS}

    def metrics_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{info['metrics_port']}/metrics" for pool in POOLS
                for _, _, info in self._live(pool) if info.get("metrics_port")]

    def scale(self, pool: str, n: int) -> None:
        with self.lock:
            live = self._live(pool)
            for _ in range(n - len(live)):
                p = self.start_worker(pool)
                log.info("planner: started %s worker pid %d", pool, p.pid)
            for name, p, _ in list(reversed(live))[:max(0, len(live) - n)]:  # the newest leave first
                self.draining.add(p.pid)
                log.info("planner: draining %s (pid %d)", name, p.pid)
                p.send_signal(signal.SIGTERM)
                t = threading.Thread(target=self._reap, args=(p,), name=f"reap-{name}", daemon=True)
                t.start()
                self.reapers.append(t)
            self.publish()

    def publish(self) -> None:
        if self.state is None:
            return
        from pdserve.planner.status import remember_local
        procs = [info for _, p, info in list(self.d.procs) if p.poll() is None]
        remember_local({**self.state, "processes": procs, "draining": sorted(self.draining)})

    def _reap(self, p: subprocess.Popen) -> None:
        try:
            p.wait(self.drain_timeout_s + 10)
        except subprocess.TimeoutExpired:
            log.warning("planner: pid %d did not drain in time; killing it", p.pid)
            p.kill()
            p.wait()
        with self.lock:  # not while scale() appends a new worker to the list being replaced
            self.d.procs = [x for x in self.d.procs if x[1] is not p]
            self.draining.discard(p.pid)
            self.publish()
        log.info("planner: worker pid %d drained and exited with %s", p.pid, p.returncode)

    def join(self, timeout_s: float) -> None:
        for t in self.reapers:
            t.join(timeout_s)


class LocalPlanner:
    """The planner thread of a `pdserve up` (its own event loop) and its metrics port."""

    def __init__(self, planner, connector: LocalConnector, metrics_port: int):
        import asyncio
        self.planner, self.connector = planner, connector
        self.info = {"metrics_port": metrics_port, "interval_s": planner.cfg.interval_s,
                     "dry_run": planner.cfg.dry_run}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(planner.run(self._stop)), name="planner",
                                       daemon=True)

    def start(self) -> None:
        """Once `up` has printed its PDSERVE_UP line."""
        self.thread.start()

    def stop(self) -> None:
        """Before `up` stops its children: no worker may be started or drained after this returns."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(self.planner.cfg.interval_s + 30)
        self.connector.join(1.0)


def start_in_up(args, deployment, start_worker: Callable[[str], subprocess.Popen], state: dict) -> LocalPlanner:
    """`state`: `up`'s PDSERVE_UP record (base_url, redis_url, processes); gains `planner` (its metrics port)."""
    from pdserve.planner.loop import Planner, PlannerConfig
    from pdserve.services import logs
    from pdserve.services.metrics import exposition
    from pdserve.services.metrics.planner import PLANNER
    from pdserve.services.up import free_port
    logs.setup("planner", args.log_format)  # the decisions' log lines (`up` itself prints plain lines)
    conn = LocalConnector(deployment, start_worker, state=state)
    cfg = PlannerConfig.from_args(args, redis_url=state["redis_url"])
    gateway = state["base_url"]
    planner = Planner(cfg, conn, lambda: [gateway + "/metrics", *conn.metrics_urls()])
    port = free_port()
    exposition.serve(exposition.exposition(PLANNER, {"model": args.served_model_name}), port, "127.0.0.1")
    lp = LocalPlanner(planner, conn, port)
    state["planner"] = lp.info
    return lp
