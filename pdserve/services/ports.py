"""Ports for the processes `up` (and tests, bench) start: chosen so that a child's bind does not race other binds.

Its own module: `up` and `preflight` (which suggests a free port in its error lines) both use it, and `up` imports
`preflight`.
"""
from __future__ import annotations

import fcntl
import json
import os
import random
import socket
import tempfile
import time

_handed_out: set[int] = set()
# How long another process's choice stays off limits: its child binds within seconds of the choice (a worker
# imports torch first), so a minute covers a loaded machine without keeping a port from a later `up` for long.
_CLAIM_S = 60.0


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _ledger_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"pdserve-ports-{os.getuid()}.json")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _read_claims(f) -> dict[int, float]:
    f.seek(0)
    try:
        raw = json.loads(f.read() or "{}")
        now = time.time()
        return {int(p): float(t) for p, t in raw.items() if float(t) > now}
    except (ValueError, TypeError, AttributeError):
        return {}  # a torn or foreign file: start over (it only ever holds short-lived claims)


def _write_claims(f, claims: dict[int, float]) -> None:
    f.seek(0)
    f.truncate()
    f.write(json.dumps({str(p): t for p, t in claims.items()}))
    f.flush()


def _rng() -> random.Random:
    return random.Random()


def _choose(low: int, taken) -> int | None:
    rng = _rng()
    for _ in range(64):
        port = rng.randrange(10000, low)
        if port not in _handed_out and port not in taken and _bindable(port):
            return port
    return None


def free_port() -> int:
    """A port free now, chosen below the kernel's ephemeral range. A port from bind(0) lies inside that range, where
    every outgoing connection (gRPC, Redis, UCX) and every other bind(0) also draws: between this check and the
    child's bind, one of them could take it, and the child fails to start ("Address already in use", seen with a
    worker's port). Below the range only another explicit chooser competes: ports handed out by this process are
    not handed out again, and other processes' recent choices (two `up`s, two pytest-xdist workers starting
    deployments at once) are kept in a per-user ledger under an flock, so that two of them never pick one port in
    the seconds before its child binds it."""
    low = _ephemeral_low()
    if low > 12000:
        try:
            with open(_ledger_path(), "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel however this process ends
                claims = _read_claims(f)
                port = _choose(low, claims)
                if port is not None:
                    claims[port] = time.time() + _CLAIM_S
                    _write_claims(f, claims)
        except OSError:
            port = _choose(low, ())  # no writable temp dir: this process's own picks still never repeat
        if port is not None:
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hand_out(ports) -> None:
    """Ports taken some other way (the ones given on `up`'s command line): `free_port` never returns them."""
    _handed_out.update(ports)
