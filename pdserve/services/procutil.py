"""Process plumbing shared by every server: signals, the drain deadline, the start-up heap (logging: logs.py)."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time

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
        from pdserve.services import logs
        logs.stop()  # os._exit skips atexit: write the queued lines (this one included) first
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


def freeze_startup_heap(what: str) -> int:
    """Move every object alive after start-up (modules, torch, protobuf descriptors, the model's Python objects)
    out of the collector's reach, and return how many were moved. A full (generation 2) collection walks every
    tracked object: 80k in a gateway, 250k+ in a worker, 50-160 ms on this project's CPUs, during which the event
    loop (and a worker's engine) stands still. Under load such a pause lands on requests in flight: the 2-core CI
    boxes saw rejections delayed past 100 ms in bursts. Frozen objects are never collected, which costs nothing
    for objects that live as long as the process; garbage made afterwards is collected as before. The same
    remedy as vLLM's `freeze_gc_heap` after its warm-up and SGLang's `freeze_gc`."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    t0 = time.perf_counter()
    gc.collect(2)
    log.info("%s: %d start-up objects frozen; a full collection now takes %.1f ms", what, n,
             (time.perf_counter() - t0) * 1000)
    return n
