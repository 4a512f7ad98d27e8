"""`pdserve` command line: up | gateway | router | worker, plus the lead's generate / bench.

Every flag also reads an environment variable (PDSERVE_<FLAG>), which is what a Kubernetes pod sets.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys


def _env(name: str, default=None):
    return os.environ.get("PDSERVE_" + name.upper().replace("-", "_"), default)


def _default_served_name(model: str) -> str:
    return "builtin" if model == "builtin" else os.path.basename(os.path.normpath(model))


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_env("model", "builtin"), help="checkpoint dir or 'builtin'")
    p.add_argument("--served-model-name", default=_env("served_model_name"),
                   help="name clients use (default: the model dir's basename)")
    p.add_argument("--host", default=_env("host", "127.0.0.1"))


def _add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-gpu-blocks", type=int, default=_env("num_gpu_blocks") and int(_env("num_gpu_blocks")))
    p.add_argument("--max-num-seqs", type=int, default=_env("max_num_seqs") and int(_env("max_num_seqs")))
    p.add_argument("--device", default=_env("device"))
    p.add_argument("--dtype", default=_env("dtype"))
    p.add_argument("--policy", default=_env("policy"),
                   help="fcfs | decode-priority | prefill-priority | priority | shortest-predicted-first")
    p.add_argument("--threads", type=int, default=_env("threads") and int(_env("threads")),
                   help="torch intra-op threads (default: all cores; `up` splits the cores between workers)")


def _add_lifecycle(p: argparse.ArgumentParser) -> None:
    """Gateway ingress gate + admission (docs/admission.md)."""
    p.add_argument("--redis-url", default=_env("redis_url"),
                   help="shared rate limits, quotas and KV reservations (unset: none of them shared)")
    p.add_argument("--api-keys-file", default=_env("api_keys_file"),
                   help="JSON/YAML tenants + keys (a mounted Secret); unset: no keys required")
    p.add_argument("--max-body-bytes", type=int, default=int(_env("max_body_bytes", 1 << 20)))
    p.add_argument("--default-timeout", type=float, default=float(_env("default_timeout", 60)),
                   help="request deadline in seconds when the body has no `timeout`")
    p.add_argument("--max-timeout", type=float, default=float(_env("max_timeout", 600)))
    p.add_argument("--admission-queue", type=int, default=int(_env("admission_queue", 16)),
                   help="requests that may wait for KV capacity per gateway; beyond: 503 at once")
    p.add_argument("--max-queue-wait", type=float, default=float(_env("max_queue_wait", 10)))
    p.add_argument("--kv-overcommit", type=float, default=float(_env("kv_overcommit", 1.0)),
                   help="reservable blocks = worker KV blocks x this")
    p.add_argument("--reservation-lease", type=float, default=float(_env("reservation_lease", 10)))


def _add_lifecycle_up(p: argparse.ArgumentParser) -> None:
    # the same flags as the gateway's, minus --redis-url (up already has one)
    tmp = argparse.ArgumentParser(add_help=False)
    _add_lifecycle(tmp)
    for a in tmp._actions:
        if a.dest != "redis_url":
            p._add_action(a)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve", description="prefill/decode disaggregated LLM serving")
    sub = ap.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a whole local deployment (redis, router, workers, gateway)")
    _add_common(up)
    _add_engine(up)
    up.add_argument("--mode", choices=["auto", "disagg", "colocated"], default=_env("mode", "auto"),
                    help="auto: prefill + decode pools, the router disaggregates a request only when that is "
                         "predicted faster (docs/routing.md); disagg: always; colocated: `both` workers only")
    up.add_argument("--prefill", type=int, default=int(_env("prefill", 1)), help="prefill workers (auto/disagg)")
    up.add_argument("--decode", type=int, default=int(_env("decode", 1)), help="decode workers (auto/disagg)")
    up.add_argument("--workers", type=int, default=int(_env("workers", 1)), help="'both' workers (colocated)")
    up.add_argument("--port", type=int, default=int(_env("port", 8000)), help="gateway HTTP port")
    up.add_argument("--grpc-port", type=int, default=int(_env("grpc_port", 0)), help="gateway gRPC port (0: auto)")
    up.add_argument("--redis-url", default=_env("redis_url"), help="default: start a private redis-server")
    up.add_argument("--lease-ttl", type=float, default=float(_env("lease_ttl", 30)))
    up.add_argument("--heartbeat-ttl", type=float, default=float(_env("heartbeat_ttl", 3)))
    up.add_argument("--ready-timeout", type=float, default=float(_env("ready_timeout", 180)))
    _add_lifecycle_up(up)

    gw = sub.add_parser("gateway", help="OpenAI HTTP API + gRPC front door")
    _add_common(gw)
    gw.add_argument("--port", type=int, default=int(_env("port", 8000)))
    gw.add_argument("--grpc-port", type=int, default=int(_env("grpc_port", 0)))
    gw.add_argument("--router", default=_env("router", "127.0.0.1:7000"), help="router gRPC address")
    _add_lifecycle(gw)
    # slow clients, big heads, who reads /metrics (docs/reliability.md "Hostile input", docs/admission.md)
    gw.add_argument("--header-timeout", type=float, default=float(_env("header_timeout", 10)),
                    help="seconds for a request head to arrive (connection open or keep-alive reuse -> headers)")
    gw.add_argument("--body-timeout", type=float, default=float(_env("body_timeout", 30)),
                    help="seconds for a request body to arrive after its head (408 then)")
    gw.add_argument("--max-header-bytes", type=int, default=int(_env("max_header_bytes", 16 << 10)),
                    help="request line + headers; larger: 431")
    gw.add_argument("--metrics-port", type=int, default=int(_env("metrics_port", 0)),
                    help="also serve /metrics here without a key (for an in-cluster scraper; 0: off)")
    gw.add_argument("--metrics-host", default=_env("metrics_host"), help="address for --metrics-port "
                    "(default --host)")

    rt = sub.add_parser("router", help="placement service over the Redis registry")
    _add_common(rt)
    rt.add_argument("--port", type=int, default=int(_env("port", 7000)))
    rt.add_argument("--redis-url", default=_env("redis_url", "redis://127.0.0.1:6379/0"))
    rt.add_argument("--metrics-port", type=int, default=int(_env("metrics_port", 0)))
    rt.add_argument("--heartbeat-ttl", type=float, default=float(_env("heartbeat_ttl", 3)))
    rt.add_argument("--mode", choices=["auto", "disagg", "colocated"], default=_env("mode", "auto"),
                    help="placement policy (docs/routing.md)")

    wk = sub.add_parser("worker", help="engine worker: --role prefill|decode|both")
    _add_common(wk)
    _add_engine(wk)
    wk.add_argument("--role", choices=["prefill", "decode", "both"], default=_env("role", "both"))
    wk.add_argument("--port", type=int, default=int(_env("port", 7100)))
    wk.add_argument("--advertise-host", default=_env("advertise_host"), help="address peers use (default --host)")
    wk.add_argument("--worker-id", default=_env("worker_id"))
    wk.add_argument("--redis-url", default=_env("redis_url", "redis://127.0.0.1:6379/0"))
    wk.add_argument("--metrics-port", type=int, default=int(_env("metrics_port", 0)))
    wk.add_argument("--heartbeat-ttl", type=float, default=float(_env("heartbeat_ttl", 3)))
    wk.add_argument("--lease-ttl", type=float, default=float(_env("lease_ttl", 30)),
                    help="seconds pinned prefill KV waits for a decode worker to pull it")
    wk.add_argument("--transfer-timeout", type=float, default=float(_env("transfer_timeout", 10)))
    wk.add_argument("--drain-timeout", type=float, default=float(_env("drain_timeout", 30)))

    # ---- lead's subcommands -----------------------------------------------------------------------------------
    # `generate` (offline engine) is added by pdserve/engine/cli_generate.py when it exists.
    try:
        from pdserve.engine.cli_generate import add_generate_parser
    except ImportError:
        pass
    else:
        add_generate_parser(sub)
    # `bench`: TODO(lead) - load generator / break-even study; add_bench_parser(sub) from pdserve/bench/cli.py.
    try:
        from pdserve.bench.cli import add_bench_parser  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    from pdserve.sim.cli import add_sim_parser
    add_sim_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if getattr(args, "served_model_name", "x") is None:
        args.served_model_name = _default_served_name(args.model)
    from pdserve.services.procutil import setup_logging
    if hasattr(args, "func"):  # generate / bench: the lead's logging setup
        import logging
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        sys.exit(args.func(args) or 0)
    if args.command == "up":
        from pdserve.services.up import up
        sys.exit(up(args))
    setup_logging(args.command)
    if args.command == "gateway":
        from pdserve.services.gateway.server import serve
        asyncio.run(serve(args))
    elif args.command == "router":
        from pdserve.services.router.server import serve
        asyncio.run(serve(args.host, args.port, args.redis_url, args.served_model_name, args.metrics_port,
                          args.heartbeat_ttl, args.mode))
    elif args.command == "worker":
        from pdserve.services.worker import serve
        asyncio.run(serve(args))
    elif hasattr(args, "func"):  # subcommands added by other modules (generate, bench) set func
        sys.exit(args.func(args) or 0)
    else:
        raise SystemExit(f"unknown command {args.command}")


if __name__ == "__main__":
    main()
