"""Process plumbing shared by every server: signals, logging."""
from __future__ import annotations

import asyncio
import logging
import os
import signal


def setup_logging(name: str) -> None:
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s")


def install_stop_signals() -> asyncio.Event:
    """SIGTERM/SIGINT set the returned event: servers drain, then exit."""
    ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ev.set)
    return ev
