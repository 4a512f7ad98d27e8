"""Scale the workers of the running `pdserve up` this planner lives in (`pdserve up --planner`).

The planner runs as a thread of the `up` process, but the children belong to `up`'s `Supervisor`, whose calls all
come from `up`'s main thread (a child's parent-death signal fires when the thread that forked it exits, so a worker
forked by the planner thread would die with it; services/supervisor.py). So `scale` only posts a request and waits;
`up`'s loop calls `apply` every tick, which grows a pool with the `start_worker(role)` function `up` hands over (the
same command line `up` starts its first workers with) and shrinks it with `Supervisor.drain`: the pool's newest
worker gets SIGTERM, i.e. its own drain (it leaves the registry so nothing new is routed to it, finishes its in-flight
requests and pinned KV leases, then exits), is SIGKILLed after its drain timeout + a grace, and is forgotten once
it exited. A draining worker no longer counts as a replica and is never restarted.

`switch(from_pool, to_pool)` moves the pool's newest worker to the other role in its process (its SwitchRole RPC,
services/role_switch.py; no fork, so the planner thread calls it itself). Its record and its command line then
say the new role, so `pdserve status` counts it there and a restart after a crash keeps it.

The hooks in services/up.py are `start_in_up` (after the deployment is ready), `LocalPlanner.apply` (each tick of
`up`'s loop) and `LocalPlanner.stop` (before `up` stops its children).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from pdserve.planner.connectors import POOLS
from pdserve.services.supervisor import Child, Supervisor

log = logging.getLogger("pdserve.planner")


@dataclass
class _Scale:
    pool: str
    n: int
    done: threading.Event = field(default_factory=threading.Event)


class LocalConnector:
    name = "local"

    def __init__(self, supervisor: Supervisor, start_worker: Callable[[str], Child], drain_timeout_s: float = 30.0,
                 state: dict | None = None, apply_timeout_s: float = 30.0):
        """`state`: `up`'s PDSERVE_UP record; rewritten (status.remember_local) at every change with the live
        processes and the draining ones, for `pdserve status`."""
        self.sup = supervisor
        self.start_worker = start_worker
        self.drain_timeout_s = drain_timeout_s
        self.state = state
        self.apply_timeout_s = apply_timeout_s
        self.requests: queue.Queue[_Scale] = queue.Queue()
        self._published_draining: list[int] | None = None

    def _children(self) -> list[Child]:
        return list(self.sup.children.values())  # one C-level copy: safe against the main thread's changes

    def _live(self, pool: str) -> list[Child]:
        return [c for c in self._children() if c.info.get("role") == pool and c.running and not c.stopped]

    def replicas(self) -> dict[str, int]:
        return {pool: len(self._live(pool)) for pool in POOLS}

    def metrics_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{c.info['metrics_port']}/metrics" for pool in POOLS
                for c in self._live(pool) if c.info.get("metrics_port")]

    def switch(self, src: str, dst: str) -> bool:
        """From the planner thread: switch the newest live `src` worker to `dst`; False when it did not switch."""
        import asyncio

        import grpc

        from pdserve.services.role_cli import switch
        live = self._live(src)
        if not live:
            return False
        c = live[-1]
        try:
            r = asyncio.run(switch(f"127.0.0.1:{c.info['port']}", dst, self.drain_timeout_s))
        except grpc.RpcError as e:
            log.warning("planner: switching %s to %s failed: %s", c.name, dst, e)
            return False
        if not r.switched:
            log.warning("planner: %s stays %s: %s", c.name, r.role, r.error)
            return False
        c.info["role"] = dst
        i = c.cmd.index("--role") if "--role" in c.cmd else -1
        if i >= 0:
            c.cmd[i + 1] = dst
        log.info("planner: switched %s %s -> %s in %.2f s (drain %.2f s)", c.name, src, dst, r.seconds, r.drain_s)
        self.publish()
        return True

    def scale(self, pool: str, n: int) -> None:
        """From the planner thread: ask `up`'s main thread to bring `pool` to `n` workers, and wait until it did."""
        req = _Scale(pool, n)
        self.requests.put(req)
        if not req.done.wait(self.apply_timeout_s):
            log.warning("planner: scaling %s to %d not applied within %.0f s", pool, n, self.apply_timeout_s)

    def apply(self) -> None:
        """From `up`'s main thread (the one that may fork children): carry out the pending scaling requests."""
        changed = False
        while True:
            try:
                req = self.requests.get_nowait()
            except queue.Empty:
                break
            live = self._live(req.pool)
            for _ in range(req.n - len(live)):
                c = self.start_worker(req.pool)
                log.info("planner: started %s worker %s (pid %d)", req.pool, c.name, c.proc.pid)
            for c in list(reversed(live))[:max(0, len(live) - req.n)]:  # the newest leave first
                log.info("planner: draining %s (pid %d)", c.name, c.proc.pid)
                self.sup.drain(c.name, self.drain_timeout_s + 10)
            req.done.set()
            changed = True
        draining = sorted(c.proc.pid for c in self.sup.draining() if c.proc is not None)
        if changed or draining != self._published_draining:
            self._published_draining = draining
            self.publish()

    def refuse_pending(self) -> None:
        """While `up` stops: release the planner from its waits without starting or draining anything."""
        while True:
            try:
                self.requests.get_nowait().done.set()
            except queue.Empty:
                return

    def publish(self) -> None:
        if self.state is None:
            return
        from pdserve.services.status import remember_local
        procs = [c.info for c in self._children() if c.running]
        draining = sorted(c.proc.pid for c in self.sup.draining() if c.proc is not None)
        remember_local({**self.state, "processes": procs, "draining": draining})


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

    def apply(self) -> None:
        """Each tick of `up`'s main loop."""
        self.connector.apply()

    def stop(self) -> None:
        """Before `up` stops its children: no worker may be started or drained after this returns."""
        self._stop.set()
        deadline = time.monotonic() + self.planner.cfg.interval_s + 30
        while self.thread.is_alive() and time.monotonic() < deadline:
            self.connector.refuse_pending()  # a scale() the planner is waiting on must not hold the join up
            self.thread.join(0.1)


def start_in_up(args, supervisor: Supervisor, start_worker: Callable[[str], Child], state: dict) -> LocalPlanner:
    """`state`: `up`'s PDSERVE_UP record (base_url, redis_url, processes); gains `planner` (its metrics port)."""
    from pdserve.planner.loop import Planner, PlannerConfig
    from pdserve.services import logs
    from pdserve.services.metrics import exposition
    from pdserve.services.metrics.planner import PLANNER
    from pdserve.services.ports import free_port
    logs.setup("planner", args.log_format)  # the decisions' log lines (`up` itself prints plain lines)
    from pdserve.services.grpc_util import configure
    from pdserve.services.internal_security import InternalSecurity
    # role switches call the workers' SwitchRole: authenticated like every internal RPC
    sec = InternalSecurity.from_files(args.internal_token_file, args.tls_cert, args.tls_key, args.tls_ca,
                                      args.tls_server_name)
    configure(sec)
    conn = LocalConnector(supervisor, start_worker, state=state)
    cfg = PlannerConfig.from_args(args, redis_url=state["redis_url"])
    gateway = state["base_url"]
    # the token: with API keys on, the gateway's /metrics asks for one, and without it the planner saw no rate
    planner = Planner(cfg, conn, lambda: [gateway + "/metrics", *conn.metrics_urls()], scrape_bearer=sec.token)
    port = free_port()
    exposition.serve(exposition.exposition(PLANNER, {"model": args.served_model_name}), port, "127.0.0.1")
    lp = LocalPlanner(planner, conn, port)
    state["planner"] = lp.info
    return lp
