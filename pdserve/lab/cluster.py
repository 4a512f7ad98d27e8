"""A pdserve deployment spread over emulated hosts (netns.py): Redis, the router, the gateway and each prefill and
decode worker on a host of its own, talking only over the shaped links.

The same processes `pdserve up` starts, run one per host under `ip netns exec`, supervised (restarted) the same way.
Closed like a default `up`: an internal token and a Redis password are generated (0600 files) and given to every
process. NIXL's UCX backend is told to use TCP (`UCX_TLS=tcp`): hosts on one machine still share memory, and
without this UCX would move KV through shared memory or CMA between them, which no real cluster can.
"""
from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.lab.netns import Host, Link, Network
from pdserve.services.leftovers import Leftovers, read_leftovers
from pdserve.services.supervisor import Supervisor

PORTS = {"redis": 6379, "router": 7000, "worker": 7100, "http": 8000, "grpc": 8001, "metrics": 9100}


@dataclass
class LabSpec:
    model: str = "builtin"
    prefill: int = 1
    decode: int = 1
    mode: str = "disagg"
    link: Link = field(default_factory=Link)       # every worker host's link
    engine_args: tuple[str, ...] = ()              # passed to every worker (e.g. --num-gpu-blocks 256)
    gateway_args: tuple[str, ...] = ()
    heartbeat_ttl: float = 3.0                     # the router's and every worker's (the fault matrix's cases time by it)
    ucx_tls: str = "tcp"
    env: dict = field(default_factory=dict)        # added to every process's environment


class LabCluster:
    """Start with `start()`, reach it at `base_url`, stop with `close()` (idempotent; also a context manager)."""

    def __init__(self, spec: LabSpec, tag: str | None = None):
        self.spec = spec
        self.net = Network(tag)
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-lab-"))
        self.sup: Supervisor | None = None
        self.workers: dict[str, Host] = {}
        # every process's output, relayed through here (as `<name>: <line>`) and kept for who reads what the
        # processes logged (the fault matrix counts the gateway's usage records in it); bounded: a long-lived
        # `pdserve lab` must not grow without end
        self.lines: deque[str] = deque(maxlen=200_000)

    @property
    def served(self) -> str:
        """The model name clients ask for (the processes get no --served-model-name: their default)."""
        m = self.spec.model
        return "builtin" if m == "builtin" else os.path.basename(os.path.normpath(m))

    # ---- addresses --------------------------------------------------------------------------------------------

    @property
    def gateway(self) -> Host:
        return self.net.hosts["gateway"]

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway.ip}:{PORTS['http']}"

    def metrics_url(self, host: str) -> str:
        return f"http://{self.net.hosts[host].ip}:{PORTS['metrics']}/metrics"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.net.hosts['redis'].ip}:{PORTS['redis']}/0"

    def redis(self, **kwargs):
        """A (synchronous) redis-py client of the lab's Redis, from the client host (kwargs are redis-py's)."""
        import redis
        kwargs.setdefault("password", (self._dir / "redis-password").read_text().strip())
        return redis.Redis.from_url(self.redis_url, **kwargs)

    def leftovers(self) -> Leftovers:
        """KV blocks in use and pinned on every worker host, reservations in the lab's Redis (None: unreadable)."""
        return read_leftovers({name: self.metrics_url(name) for name in self.workers},
                              lambda: self.redis(socket_timeout=2), self.served)

    # ---- start / stop -----------------------------------------------------------------------------------------

    def start(self, ready_timeout: float = 180.0) -> LabCluster:
        token, password = self._secret("internal-token"), self._secret("redis-password")
        env = {**os.environ, **self.spec.env, **({"UCX_TLS": self.spec.ucx_tls} if self.spec.ucx_tls else {})}
        self.sup = Supervisor(env, restart=False, log=self._log)
        hosts = {name: self.net.add_host(name) for name in ("redis", "router", "gateway")}
        for role, n in (("prefill", self.spec.prefill), ("decode", self.spec.decode)):
            for i in range(n):
                self.workers[f"{role}-{i}"] = self.net.add_host(f"{role}-{i}", self.spec.link)
        redis_url = self.redis_url
        common = ["--model", self.spec.model, "--internal-token-file", str(token),
                  "--redis-password-file", str(password)]
        pw = password.read_text().strip()
        self._on(hosts["redis"], "redis", [shutil.which("redis-server") or "redis-server", "-", "--port",
                 str(PORTS["redis"]), "--bind", hosts["redis"].ip, "--save", "", "--appendonly", "no",
                 "--loglevel", "warning"], stdin_data=f'requirepass "{pw}"\n'.encode())
        self._on(hosts["router"], "router", [*_pdserve(), "router", *common, "--host", hosts["router"].ip,
                 "--port", str(PORTS["router"]), "--redis-url", redis_url, "--metrics-port", str(PORTS["metrics"]),
                 "--mode", self.spec.mode, "--heartbeat-ttl", str(self.spec.heartbeat_ttl)])
        for name, h in self.workers.items():
            self._on(h, name, [*_pdserve(), "worker", *common, *self.spec.engine_args, "--role",
                     name.split("-")[0], "--host", h.ip, "--advertise-host", h.ip, "--port", str(PORTS["worker"]),
                     "--worker-id", name, "--redis-url", redis_url, "--metrics-port", str(PORTS["metrics"]),
                     "--heartbeat-ttl", str(self.spec.heartbeat_ttl)])
        g = hosts["gateway"]
        self._on(g, "gateway", [*_pdserve(), "gateway", *common, *self.spec.gateway_args, "--host", g.ip,
                 "--port", str(PORTS["http"]), "--grpc-port", str(PORTS["grpc"]),
                 "--router", f"{hosts['router'].ip}:{PORTS['router']}", "--redis-url", redis_url,
                 "--metrics-port", str(PORTS["metrics"])])
        self._wait_ready(time.monotonic() + ready_timeout)
        self.sup.restart = True
        return self

    def _on(self, host: Host, name: str, cmd: list[str], stdin_data: bytes | None = None) -> None:
        self.sup.start(name, [*host.exec_prefix(), *cmd], {"host": host.name, "ip": host.ip},
                       stdin_data=stdin_data, relay=True)

    def _log(self, line: str) -> None:
        """The supervisor's and the relayed children's lines (called from the relay threads): kept, and on
        stderr as before."""
        self.lines.append(line)
        print(line, file=sys.stderr, flush=True)

    def _secret(self, name: str) -> Path:
        p = self._dir / name
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        return p

    def _wait_ready(self, end: float) -> None:
        """Until the gateway's /health counts every worker."""
        import json
        want = len(self.workers)
        while time.monotonic() < end:
            self.sup.poll()
            dead = self.sup.dead()
            if dead is not None:
                raise RuntimeError(f"lab: {dead.name} exited with code {dead.proc.returncode}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    body = json.loads(r.read())
                if sum(body.get("workers", {}).values()) >= want:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"lab: not ready with {want} workers")

    def processes(self) -> list[dict]:
        """Each component: name, role (workers), pid, host, ip (what `pdserve up`'s PDSERVE_UP record lists)."""
        out = []
        for name, c in (self.sup.children.items() if self.sup else ()):
            role = name.split("-")[0] if name in self.workers else None
            out.append({**c.info, "name": name, "role": role, "pid": c.proc.pid if c.proc else None})
        return out

    def close(self) -> None:
        if self.sup is not None:
            self.sup.restart = False
            self.sup.stop_all(15.0)
            self.sup = None
        self.net.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LabCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _pdserve() -> list[str]:
    return [sys.executable, "-m", "pdserve"]
