"""Flag groups that several commands declare, and the checks on them: the internal transport's security flags
(up, gateway, router, worker, planner) and the planner's (`pdserve planner`, `pdserve up --planner`).

Here rather than in `cli.py` or `planner/cli.py` so that the command modules and `services/preflight.py` share them
without importing each other (tests/test_import_graph.py). Imports nothing of pdserve but `cli_args`.
"""
from __future__ import annotations

import argparse

from pdserve.cli_args import nonneg_float, positive_float, positive_int


def add_security(p: argparse.ArgumentParser) -> None:
    """Internal transport security (docs/services.md, Trust model). Secrets come as files, never as values; the
    files are read (and a missing one reported) once the command line is parsed: `cli._check_security`."""
    p.add_argument("--internal-token-file",
                   help="shared token for router/worker RPCs and registry records (a mounted Secret)")
    p.add_argument("--tls-cert", help="PEM certificate for internal gRPC (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca",
                   help="PEM CA: servers require client certificates it signed (mTLS), clients verify servers by it")
    p.add_argument("--tls-server-name", help="name internal servers' certificates carry (default: the dialed host)")
    p.add_argument("--redis-password-file", help="Redis AUTH password (username, if any, in --redis-url)")
    p.add_argument("--redis-ca-file", help="PEM CA for a rediss:// (TLS) Redis")
    p.add_argument("--insecure-internal", action="store_true", default=None,  # None: help prints no default
                   help="run without internal authentication, said at WARNING (up: generate no token or Redis "
                        "password; router/worker: serve a non-loopback address without a token or mTLS)")


def add_planner_flags(p) -> None:
    """What `pdserve up --planner` and `pdserve planner` share."""
    p.add_argument("--planner-interval", type=positive_float, default=30.0, help="seconds between decisions")
    p.add_argument("--slo-ttft", type=positive_float, default=0.5, help="TTFT SLO (p90, seconds) the planner sizes for")
    p.add_argument("--slo-tpot", type=positive_float, default=0.05, help="TPOT SLO (p90, seconds)")
    p.add_argument("--min-prefill", type=positive_int, default=1, help="planner: fewest prefill workers")
    p.add_argument("--max-prefill", type=positive_int, default=4, help="planner: most prefill workers")
    p.add_argument("--min-decode", type=positive_int, default=1, help="planner: fewest decode workers")
    p.add_argument("--max-decode", type=positive_int, default=4, help="planner: most decode workers")
    p.add_argument("--scale-down-cooldown", type=nonneg_float, default=None,
                   help="seconds after a pool's last change before it may shrink (default: 2 intervals)")
    p.add_argument("--planner-window", type=positive_int, default=6,
                   help="intervals the forecast looks back (a pool shrinks only when all of them needed fewer)")
    p.add_argument("--headroom", type=positive_float, default=1.2, help="size for the forecast rate x this")
    p.add_argument("--attainment", type=positive_float, default=0.9, help="target SLO attainment in simulation")


def add_up_flags(up) -> None:
    up.add_argument("--planner", action="store_true", default=None,  # None: no "(default: False)" in --help
                    help="run the SLA planner in this process: it adds and drains workers (docs/planner.md)")
    add_planner_flags(up)


def check_limits(a) -> str | None:
    for pool in ("prefill", "decode"):
        lo, hi = getattr(a, f"min_{pool}"), getattr(a, f"max_{pool}")
        if lo > hi:
            return f"--min-{pool} {lo} is above --max-{pool} {hi}"
    if a.planner_window < 2:
        return "--planner-window needs at least 2 intervals"
    return None


def check_up_planner(a) -> str | None:
    if a.mode == "colocated":
        return "--planner sizes prefill and decode pools: use --mode auto or disagg"
    return check_limits(a)
