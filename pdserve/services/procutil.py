"""Process plumbing shared by every server: signals and the drain deadline (logging: logs.py)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading

# What a process may spend tearing down after its drain (closing servers, Redis, NIXL) before it is cut short.
EXIT_GRACE_S = 3.0
EXIT_STUCK = 70  # exit code of a process its deadline ended (os._exit: EX_SOFTWARE)

log = logging.getLogger("pdserve.procutil")


def exit_deadline(seconds: float, what: str) -> threading.Timer:
    """From now, the process exits at the latest `seconds` later, whatever it is stuck on: a drain waiting for a
    Redis that is gone, a peer that does not answer, a non-daemon thread. A Kubernetes pod gets SIGKILL after
    its grace period anyway; this makes the bound the process's own, so `pdserve up`, a test or an operator's
    SIGTERM sees it gone within its drain timeout (docs/reliability.md, "Supervision")."""
    def expire() -> None:
        msg = f"{what}: still running {seconds:.1f} s after the stop signal; exiting now"
        log.error(msg)
        print(msg, file=sys.stderr, flush=True)
        os._exit(EXIT_STUCK)

    t = threading.Timer(seconds, expire)
    t.daemon = True
    t.start()
    return t


def install_stop_signals(drain_s: float | None = None, what: str = "pdserve") -> asyncio.Event:
    """SIGTERM/SIGINT set the returned event: servers drain, then exit. With `drain_s`, the first signal also
    arms `exit_deadline(drain_s + EXIT_GRACE_S)`."""
    ev = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if not ev.is_set() and drain_s is not None:
            exit_deadline(drain_s + EXIT_GRACE_S, what)
        ev.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    return ev
