"""Ports for the processes `up` (and tests, bench) start: chosen so that a child's bind does not race other binds.

Its own module: `up` and `preflight` (which suggests a free port in its error lines) both use it, and `up` imports
`preflight`.
"""
from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, chosen below the kernel's ephemeral range. A port from bind(0) lies inside that range, where
    every outgoing connection (gRPC, Redis, UCX) and every other bind(0) also draws: between this check and the
    child's bind, one of them could take it, and the child fails to start ("Address already in use", seen with a
    worker's port). Below the range only another explicit chooser competes; ports handed out by this process are
    not handed out again."""
    low = _ephemeral_low()
    if low > 12000:
        rng = random.Random()
        for _ in range(64):
            port = rng.randrange(10000, low)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hand_out(ports) -> None:
    """Ports taken some other way (the ones given on `up`'s command line): `free_port` never returns them."""
    _handed_out.update(ports)
