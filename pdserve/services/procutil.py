"""Process plumbing shared by every server: signals (logging: logs.py)."""
from __future__ import annotations

import asyncio
import signal


def install_stop_signals() -> asyncio.Event:
    """SIGTERM/SIGINT set the returned event: servers drain, then exit."""
    ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ev.set)
    return ev
