"""`pdserve up` as a child process: start it, wait for its PDSERVE_UP line, read its processes, stop it.

Used by `pdserve bench breakeven` (deployments per cell) and by the end-to-end tests.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading


class UpProcess:
    def __init__(self, args: list[str], env: dict | None = None, ready_timeout: float = 90.0):
        """`args` follow `pdserve up`; the HTTP port is chosen here (free) unless args give one."""
        from pdserve.services.ports import free_port
        if "--port" in args:
            self.port = int(args[args.index("--port") + 1])
        else:
            self.port = free_port()
            args = [*args, "--port", str(self.port)]
        self.cmd = [sys.executable, "-m", "pdserve", "up", *args]
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.info: dict | None = None
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("PDSERVE_UP "):
                    self.info = json.loads(line[len("PDSERVE_UP "):])
                    ready.set()
                elif line.startswith("PDSERVE_CHILD ") and self.info is not None:
                    # a child restarted by up's supervisor: its new pid and restart count, in place
                    child = json.loads(line[len("PDSERVE_CHILD "):])
                    for p in self.info["processes"]:
                        if p["name"] == child["name"]:
                            p.update(child)
            ready.set()  # the process ended without becoming ready

        threading.Thread(target=read, daemon=True).start()
        try:
            became_ready = ready.wait(ready_timeout)
        except BaseException:  # Ctrl-C while starting: the child has its own session, so it never saw the signal
            self.stop()
            raise
        if not became_ready or self.info is None:
            self.stop()
            raise RuntimeError("pdserve up did not become ready:\n" + "".join(self.lines[-50:]))
        self.base_url: str = self.info["base_url"]

    def workers(self, role: str | None = None) -> list[dict]:
        return [p for p in self.info["processes"] if p.get("role") and (role is None or p["role"] == role)]

    def process(self, name: str) -> dict:
        return next(p for p in self.info["processes"] if p["name"] == name)

    # A default `up` is closed (up.py): what joins it or calls inside it needs the files it generated.

    def security_flags(self) -> list[str]:
        """The flags a process joining this deployment needs (its token and Redis password files)."""
        out = []
        for key in ("internal_token_file", "redis_password_file"):
            if self.info.get(key):
                out += ["--" + key.replace("_", "-"), self.info[key]]
        return out

    def redis(self, **kwargs):
        """A (synchronous) client of the deployment's Redis; kwargs are redis-py's."""
        import redis

        from pdserve.services.redis_conn import RedisAuth
        kwargs.setdefault("password", RedisAuth.from_files(self.info.get("redis_password_file")).password)
        return redis.Redis.from_url(self.info["redis_url"], **kwargs)

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata for a direct call to the router or a worker."""
        from pdserve.services.internal_security import AUTH_HEADER, read_token
        path = self.info.get("internal_token_file")
        return ((AUTH_HEADER, f"Bearer {read_token(path)}"),) if path else ()

    def metrics_urls(self) -> list[str]:
        return [self.base_url + "/metrics"] + [f"http://127.0.0.1:{w['metrics_port']}/metrics"
                                               for w in self.workers()]

    def wait_restart(self, name: str, old_pid: int, timeout: float = 60.0) -> dict:
        """The info of child `name` once up announced it restarted under a pid other than `old_pid` (the entries of
        `info["processes"]` are updated in place: read `old_pid` before the child can restart)."""
        import time
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            p = self.process(name)
            if p["pid"] != old_pid:
                return p
            time.sleep(0.05)
        raise TimeoutError(f"{name} not restarted within {timeout} s:\n" + "".join(
            l for l in self.lines if "pdserve up" in l or "PDSERVE_" in l or name in l))

    def stop(self, timeout: float = 40.0) -> int:
        """SIGTERM (`pdserve up` drains and stops its children), SIGKILL of the group if it hangs (the children,
        in their own sessions, follow through their parent-death signal)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
