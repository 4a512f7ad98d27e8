"""The children of `pdserve up`, supervised the way Kubernetes supervises a pod's containers.

API (one `Supervisor` per `up`; all calls from the one thread that also calls `poll`, see "Threads" below):

- `start(name, cmd, info, stdin_data=None)` starts a child (also how a worker is added to a running deployment);
- `poll()` reaps the children that exited and restarts each (same command: same ports, same worker id) once its
  backoff is due; call it every ~0.2 s;
- `stop(name, grace)` SIGTERMs one child (it drains), SIGKILLs it after `grace`, and no longer restarts it;
  `remove(name, grace)` also forgets it; `drain(name, grace)` is `remove` without waiting (SIGTERM now, SIGKILL
  and forgetting by `poll`: how the planner removes a worker while `up` keeps supervising the rest);
  `stop_all(grace)` stops all, newest first.

Restart policy: with `restart` on, a child that exits for any reason (crash, SIGKILL, its own SIGTERM drain) is
started again after a backoff of 0.5 s, doubling up to 30 s, reset once a child has run for 60 s
(CrashLoopBackOff in small: a child that cannot start does not spin a core). Every restart is counted
(`Child.restarts`), logged on stderr, and announced on stdout as one `PDSERVE_CHILD {json}` line (name, pid,
restarts, the exit that caused it) so an operator's log search and scripts (`UpProcess`) see the new pid.

Lifetime: each child runs in its own session (a Ctrl-C on the terminal reaches `up` only, which then stops the
children in order) and is tied to `up` by the Linux parent-death signal: between fork and exec the child sets
PR_SET_PDEATHSIG(SIGKILL), then checks that its parent is still the process that forked it (`up` may have died
before the prctl, and the signal would then never come). So a `pdserve up` killed with SIGKILL takes its router,
workers, gateway and Redis with it within moments, and their ports are free again. SIGKILL rather than SIGTERM:
whoever killed `up` wanted the deployment gone now, and a worker draining for its gateway, which is dead too,
would only hold its port longer.

Threads: the parent-death signal fires when the *thread* that forked the child exits, not the process. Call
`start` (and `poll`, which restarts) from one long-lived thread — `up`'s main thread — never from a short-lived
worker thread, or the child dies with that thread. `preexec_fn` is also only safe while that thread is the only
one that forks.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_S = 60.0  # a child that ran this long before exiting restarts after BACKOFF_FIRST_S again
PR_SET_PDEATHSIG = 1

# Loaded in the parent: nothing may be dlopen'ed between fork and exec.
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _tie_to_parent(parent_pid: int):
    """preexec_fn: die with `parent_pid` (Linux); elsewhere a no-op."""
    def pre() -> None:
        if _libc is None:
            return
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the prctl: the signal will never come
            os._exit(1)
    return pre


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


@dataclass
class Child:
    name: str
    cmd: list[str]
    info: dict                      # what `PDSERVE_UP` publishes about it (ports, role, ...); pid kept current
    stdin_data: bytes | None = None  # written to its stdin at every start (redis-server reads its password so)
    relay: bool = False             # its stdout/stderr go through up's own (queued, never blocking) log
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started: float = 0.0             # monotonic, of the current incarnation
    last_exit: int | None = None
    restart_at: float | None = None  # monotonic time of the pending restart, None: none pending
    backoff_s: float = BACKOFF_FIRST_S
    stopped: bool = False            # stopped on purpose: never restarted
    drain_deadline: float | None = None  # monotonic: SIGKILL then if still draining (see Supervisor.drain)
    history: list[dict] = field(default_factory=list)  # one entry per exit: code, ran_s

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, env: dict, restart: bool = True, log=None, announce=None):
        """`restart`: restart children that exit (may be switched later: `up` starts with it off, so a child
        that dies before the deployment is ready fails `up` at once). `log(str)` / `announce(str)` default to
        stderr / stdout."""
        self.env = env
        self.restart = restart
        self.children: dict[str, Child] = {}
        self._log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self._announce = announce or (lambda s: print(s, flush=True))

    # ---- starting and stopping ----------------------------------------------------------------------------------
    def start(self, name: str, cmd: list[str], info: dict | None = None,
              stdin_data: bytes | None = None, relay: bool = False) -> Child:
        """Start a new child called `name` (unique). Also how a worker is added to a running deployment.
        `relay`: for a program that writes its output in blocking writes (redis-server): its lines reach up's own
        log, whose queue drops rather than waits, so a sink nobody reads cannot hold the child (at exit, too)."""
        if name in self.children:
            raise ValueError(f"a child called {name!r} exists")
        c = Child(name, list(cmd), {"name": name, **(info or {})}, stdin_data, relay=relay)
        self.children[name] = c
        self._spawn(c)
        return c

    def _spawn(self, c: Child) -> None:
        out = subprocess.PIPE if c.relay else None
        c.proc = subprocess.Popen(c.cmd, env=self.env, start_new_session=True, preexec_fn=_tie_to_parent(os.getpid()),
                                  stdin=subprocess.PIPE if c.stdin_data is not None else None, stdout=out,
                                  stderr=subprocess.STDOUT if c.relay else None)
        if c.relay:  # ends at the pipe's EOF: when this incarnation exits
            threading.Thread(target=self._relay, args=(c.name, c.proc.stdout), name=f"relay-{c.name}",
                             daemon=True).start()
        if c.stdin_data is not None:
            c.proc.stdin.write(c.stdin_data)
            c.proc.stdin.close()
        c.started = time.monotonic()
        c.restart_at = None
        c.info["pid"] = c.proc.pid
        c.info["restarts"] = c.restarts

    def _relay(self, name: str, stream) -> None:
        with stream:
            for raw in stream:
                self._log(f"{name}: " + raw.decode(errors="replace").rstrip())

    def stop(self, name: str, grace: float = 15.0) -> int | None:
        """SIGTERM (the child drains), SIGKILL after `grace` s; never restarted afterwards. Its exit code."""
        c = self.children[name]
        c.stopped = True
        c.restart_at = None
        if c.proc is None:
            return None
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
            try:
                c.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._log(f"pdserve up: {name} still running {grace:.0f} s after SIGTERM; SIGKILL")
                c.proc.kill()
                c.proc.wait()
        return c.proc.returncode

    def remove(self, name: str, grace: float = 15.0) -> int | None:
        """Stop `name` and forget it (how a worker is removed from a running deployment)."""
        code = self.stop(name, grace)
        del self.children[name]
        return code

    def drain(self, name: str, grace: float) -> None:
        """SIGTERM `name` now (its own drain); `poll` SIGKILLs it `grace` s later if still running and forgets it
        once it exited. Never restarted."""
        c = self.children[name]
        c.stopped = True
        c.restart_at = None
        c.drain_deadline = time.monotonic() + grace
        if c.running:
            c.proc.send_signal(signal.SIGTERM)

    def draining(self) -> list[Child]:
        return [c for c in self.children.values() if c.drain_deadline is not None]

    def stop_all(self, grace: float = 15.0) -> None:
        """Everyone, newest first (the gateway before the workers before the router before Redis)."""
        for name in reversed(list(self.children)):
            self.stop(name, grace)

    # ---- supervision --------------------------------------------------------------------------------------------
    def poll(self) -> list[Child]:
        """Reap children that exited (scheduling their restart when restarting is on) and start those whose backoff
        is due. Returns the children found exited by this call."""
        now = time.monotonic()
        exited = []
        for c in list(self.children.values()):
            if c.drain_deadline is not None:
                if not c.running:
                    self._log(f"pdserve up: {c.name} drained and exited with {describe_exit(c.proc.returncode)}")
                    del self.children[c.name]
                elif now >= c.drain_deadline:
                    self._log(f"pdserve up: {c.name} still draining at its deadline; SIGKILL")
                    c.proc.kill()
                continue
            if c.stopped or c.proc is None:
                continue
            if c.restart_at is None and c.proc.poll() is not None:
                exited.append(c)
                self._exited(c, now)
            if c.restart_at is not None and now >= c.restart_at:
                c.restarts += 1
                self._spawn(c)
                self._log(f"pdserve up: restarted {c.name} (pid {c.proc.pid}, restarts {c.restarts})")
                self._announce("PDSERVE_CHILD " + json.dumps({**c.info, "last_exit": c.last_exit}))
        return exited

    def _exited(self, c: Child, now: float) -> None:
        ran = now - c.started
        c.last_exit = c.proc.returncode
        c.history.append({"code": c.last_exit, "ran_s": round(ran, 3)})
        if not self.restart:
            self._log(f"pdserve up: {c.name} (pid {c.proc.pid}) exited with {describe_exit(c.last_exit)} after "
                      f"{ran:.1f} s; not restarted")
            c.restart_at = float("inf")  # reaped: not reported again
            return
        if ran >= BACKOFF_RESET_S:
            c.backoff_s = BACKOFF_FIRST_S
        delay = c.backoff_s
        c.backoff_s = min(BACKOFF_MAX_S, c.backoff_s * 2)
        c.restart_at = now + delay
        self._log(f"pdserve up: {c.name} (pid {c.proc.pid}) exited with {describe_exit(c.last_exit)} after "
                  f"{ran:.1f} s; restart {c.restarts + 1} in {delay:.1f} s")

    def dead(self) -> Child | None:
        """The first child that exited and will not be restarted (restarting off), if any."""
        for c in self.children.values():
            if not c.stopped and c.proc is not None and c.proc.poll() is not None and not self.restart:
                return c
        return None

    def infos(self) -> list[dict]:
        return [c.info for c in self.children.values()]
