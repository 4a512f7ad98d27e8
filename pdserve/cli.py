"""`pdserve` command line: up | gateway | router | worker (services), generate (offline engine), bench, sim.

Every flag of up / gateway / router / worker also reads an environment variable (PDSERVE_<FLAG>), which is what a
Kubernetes pod sets. Errors are one line; -v / --verbose adds the traceback.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from pdserve.cli_args import (
    Parser,
    labels_arg,
    list_arg,
    nonneg_float,
    nonneg_int,
    port,
    positive_float,
    positive_int,
    print_error,
    weights_arg,
)
from pdserve.cli_flags import BATCHING, DTYPES, POLICIES, PREEMPTION_MODES, add_engine  # noqa: F401 - names tests use
from pdserve.cli_flags import add_security as _add_security

MODES = ("auto", "disagg", "colocated")
# The router's placement policies a deployment may select (services/router/policy_registry.py names(); not
# imported: it pulls in the services package).
PLACEMENTS = ("cache-aware", "round-robin", "least-loaded")
PLACEMENT_HELP = ("placement policy by name (docs/routing.md, Placement policies): cache-aware predicts completion "
                  "time from prefix hits and load; round-robin and least-loaded are baselines that place on "
                  "colocated (both) workers only")
LOG_FORMATS = ("text", "json")  # pdserve/services/logs.py FORMATS (not imported: it pulls in the services package)


def _default_served_name(model: str) -> str:
    return "builtin" if model == "builtin" else os.path.basename(os.path.normpath(model))


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin", help="checkpoint dir or 'builtin'")
    p.add_argument("--served-model-name", help="name clients use (default: the model dir's basename)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--metrics-compat", choices=["vllm"], default=None,
                   help="also export the metrics under vLLM's names (docs/metrics.md)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="text lines, or one JSON object a line with the request id (docs/observability.md)")


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # pdserve/services/gateway/tools/registry.py


def _add_lifecycle(p: argparse.ArgumentParser, redis_url: bool = True) -> None:
    """Gateway ingress gate + admission (docs/admission.md). `up` has its own --redis-url (its private Redis)."""
    if redis_url:
        p.add_argument("--redis-url",
                       help="shared rate limits, quotas and KV reservations (unset: none of them shared)")
    p.add_argument("--api-keys-file", help="JSON/YAML tenants + keys (a mounted Secret); unset: no keys required")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20)
    p.add_argument("--default-timeout", type=positive_float, default=60.0,
                   help="request deadline in seconds when the body has no `timeout`")
    p.add_argument("--max-timeout", type=positive_float, default=600.0)
    p.add_argument("--admission-queue", type=nonneg_int, default=16,
                   help="requests that may wait for KV capacity per gateway; beyond: 503 at once")
    p.add_argument("--max-queue-wait", type=nonneg_float, default=10.0)
    p.add_argument("--kv-overcommit", type=positive_float, default=1.0, help="reservable blocks = worker KV blocks x this")
    p.add_argument("--reservation-lease", type=positive_float, default=10.0)
    p.add_argument("--default-max-tokens", type=positive_int, default=None,
                   help="output cap of a request without max_tokens (min with the context left); unset: the context "
                        "(docs/api.md)")
    p.add_argument("--max-logprob-entries", type=positive_int, default=500_000,
                   help="log-prob values one answer may carry (tokens x n x (1 + top log-probs), output and echoed "
                        "prompt); more: 400 naming logprobs (docs/api.md, Limits)")
    p.add_argument("--migration-limit", type=nonneg_int, default=2,
                   help="times a request may move to another worker after its worker died mid-stream (0: never; "
                        "docs/reliability.md, Mid-stream migration)")
    p.add_argument("--require-disagg", action="store_true", default=None,  # None: no "(default: False)"
                   help="answer 503 disagg_unavailable, naming the router's reason, instead of prefilling a request "
                        "on the worker that decodes it (docs/routing.md, Which path served a request)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the model's tool call format (docs/api.md, Tool calling); unset: the one the chat template "
                        "writes, else hermes")


def _add_grammar(p: argparse.ArgumentParser, worker: bool) -> None:
    """Bounds on guided-output constraints (engine/grammar_limits.py; docs/api.md, "Limits"). The gateway refuses
    over them with a 400 naming the limit; a worker checks again and compiles within the timeout."""
    from pdserve.engine.grammar_limits import LIMIT_FLAGS, GrammarLimits
    defaults = GrammarLimits()
    for flag, (attr, text) in LIMIT_FLAGS.items():
        kind = positive_float if attr == "grammar_compile_timeout" else positive_int
        p.add_argument(flag, dest=attr, type=kind, default=None, help=f"{text} (default: {getattr(defaults, attr)})")
    if worker:
        p.add_argument("--grammar-processes", type=positive_int, default=None,
                       help="processes compiling guided-output grammars off the engine thread (default: 2)")
        p.add_argument("--grammar-start", choices=("eager", "lazy"), default=None,
                       help="start those processes with the worker (eager, the default: no constrained request "
                            "waits for one to start), or at the first constrained request (lazy: a worker that "
                            "never sees one saves ~3 s of CPU and ~300 MB per process)")


def _add_browser(p: argparse.ArgumentParser) -> None:
    """What a web page may make the gateway do (docs/api.md, Browsers): nothing, unless these say so."""
    p.add_argument("--allowed-hosts", type=list_arg, default=(), metavar="HOST,...",
                   help="Host header names accepted besides localhost, 127.0.0.1 and [::1] (any port); others get "
                        "421. Checked when the gateway listens on loopback or when this is set; `*`: any")
    p.add_argument("--allowed-origins", type=list_arg, default=(), metavar="ORIGIN,...",
                   help="browser origins (e.g. https://app.example) allowed to call the API (CORS); unset: none")


def build_parser() -> argparse.ArgumentParser:
    """Flags of up / gateway / router / worker also read PDSERVE_<FLAG> (what a Kubernetes pod sets), parsed and
    checked like the flag when the command line is parsed (pdserve/cli_args.py)."""
    ap = Parser(prog="pdserve", description="prefill/decode disaggregated LLM serving")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_up(sub)
    _add_gateway(sub)
    _add_router(sub)
    _add_worker(sub)
    from pdserve.bench.cli import add_bench_parser
    from pdserve.engine.cli_generate import add_generate_parser
    from pdserve.lab.cli import add_lab_parser
    from pdserve.planner.cli import add_planner_parser, add_status_parser
    from pdserve.planner.shift_cli import add_shift_parser
    from pdserve.sim.cli import add_sim_parser
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_shift_parser(add_sim_parser(sub))  # `sim shift`: the planner's split controller in the simulator
    add_lab_parser(sub)
    add_planner_parser(sub)
    add_status_parser(sub)
    from pdserve.services.role_cli import add_worker_role_parser
    add_worker_role_parser(sub)
    return ap


def _add_up(sub) -> None:
    """`up` has ~75 flags: --help shows them in groups, in the order a user reads them."""
    up = sub.add_parser("up", env=True, help="start a whole local deployment (redis, router, workers, gateway)",
                        usage="%(prog)s [FLAG ...]  (the flags, grouped, below)")
    _add_common(up.add_argument_group("model and listening"))
    d = up.add_argument_group("deployment")
    d.add_argument("--mode", choices=MODES, default="auto",
                   help="auto: prefill + decode pools, the router disaggregates a request only when that is "
                        "predicted faster (docs/routing.md); disagg: always; colocated: `both` workers only")
    d.add_argument("--placement", choices=PLACEMENTS, default="cache-aware", help=PLACEMENT_HELP)
    d.add_argument("--prefill", type=nonneg_int, default=1, help="prefill workers (auto/disagg)")
    d.add_argument("--decode", type=nonneg_int, default=1, help="decode workers (auto/disagg)")
    d.add_argument("--workers", type=nonneg_int, default=1, help="'both' workers (colocated)")
    d.add_argument("--prefill-tp", type=positive_int, help="tensor parallel size of prefill workers "
                   "(default: --tensor-parallel-size)")
    d.add_argument("--decode-tp", type=positive_int, help="tensor parallel size of decode workers "
                   "(default: --tensor-parallel-size)")
    d.add_argument("--prefill-ep", type=positive_int, help="expert parallel size of prefill workers: 1, their "
                   "tensor parallel size, or any size at tensor parallel size 1 (default: --expert-parallel-size)")
    d.add_argument("--decode-ep", type=positive_int, help="expert parallel size of decode workers: 1, their "
                   "tensor parallel size, or any size at tensor parallel size 1 (default: --expert-parallel-size)")
    d.add_argument("--routers", type=positive_int, default=1,
                   help="routers, active-active: each rebuilds its view from Redis, the gateway fails over between "
                        "them within a request (docs/reliability.md, Routers)")
    d.add_argument("--port", type=port, default=8000, help="gateway HTTP port")
    d.add_argument("--grpc-port", type=port, default=0, help="gateway gRPC port (0: a free one)")
    d.add_argument("--redis-url", help="an existing Redis (default: start a private redis-server)")
    d.add_argument("--lease-ttl", type=positive_float, default=30.0)
    d.add_argument("--heartbeat-ttl", type=positive_float, default=3.0)
    d.add_argument("--ready-timeout", type=positive_float, default=180.0)
    d.add_argument("--no-restart", action="store_true", default=None,  # None: help prints no "default: False"
                   help="do not restart a child that exits (default: restart with backoff, docs/reliability.md)")
    d.add_argument("--drain-timeout", type=nonneg_float, default=None,
                   help="passed to every child (default: each its own)")
    d.add_argument("--switch-handoff", choices=("migrate", "drain"), default=None,
                   help="passed to every worker: a role switch's streams finish first or migrate "
                        "(default: the worker's, drain)")
    d.add_argument("--worker-cpus", type=positive_float, default=None,
                   help="cap every worker at this many CPUs (a cgroup quota; root): each worker becomes a host of "
                        "its own size, as on a cluster, instead of all sharing this machine's cores "
                        "(docs/planner.md, Role switching measured)")
    add_engine(up.add_argument_group("engine (every worker)"))
    _add_lifecycle(up.add_argument_group("admission and limits (gateway)"), redis_url=False)
    _add_grammar(up.add_argument_group("guided output"), worker=True)
    _add_browser(up.add_argument_group("browsers"))
    _add_security(up.add_argument_group("internal security"))
    from pdserve.cli_flags import add_up_flags
    add_up_flags(up.add_argument_group("planner (docs/planner.md)"))


def _add_gateway(sub) -> None:
    gw = sub.add_parser("gateway", env=True, help="OpenAI HTTP API + gRPC front door")
    _add_common(gw)
    gw.add_argument("--port", type=port, default=8000)
    gw.add_argument("--grpc-port", type=port, default=0)
    gw.add_argument("--router", default="127.0.0.1:7000", help="router gRPC address; several, comma-separated: "
                    "the gateway fails over between them (active-active routers)")
    _add_lifecycle(gw.add_argument_group("admission and limits"))
    _add_grammar(gw.add_argument_group("guided output"), worker=False)
    _add_browser(gw.add_argument_group("browsers"))
    _add_security(gw.add_argument_group("internal security"))
    # slow clients, big heads, who reads /metrics (docs/reliability.md "Hostile input", docs/admission.md)
    c = gw.add_argument_group("connections")
    c.add_argument("--header-timeout", type=positive_float, default=10.0,
                   help="seconds for a request head to arrive (connection open or keep-alive reuse -> headers)")
    c.add_argument("--body-timeout", type=positive_float, default=30.0,
                   help="seconds for a request body to arrive after its head (408 then)")
    c.add_argument("--max-header-bytes", type=positive_int, default=16 << 10,
                   help="request line + headers; larger: 431")
    c.add_argument("--metrics-port", type=port, default=0,
                   help="also serve /metrics here without a key (for an in-cluster scraper; 0: off)")
    c.add_argument("--metrics-host", default=None, help="address for --metrics-port "
                   "(default --host)")
    c.add_argument("--drain-timeout", type=nonneg_float, default=5.0,
                   help="SIGTERM: seconds open requests may finish; the process is gone 3 s later at most")


def _add_router(sub) -> None:
    rt = sub.add_parser("router", env=True, help="placement service over the Redis registry")
    _add_common(rt)
    rt.add_argument("--port", type=port, default=7000)
    rt.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    rt.add_argument("--metrics-port", type=port, default=0)
    rt.add_argument("--heartbeat-ttl", type=positive_float, default=3.0)
    rt.add_argument("--placement", choices=PLACEMENTS, default="cache-aware", help=PLACEMENT_HELP)
    rt.add_argument("--mode", choices=MODES, default="auto",
                    help="cache-aware placement: disaggregate when predicted faster (auto), always (disagg), or "
                         "never (colocated) (docs/routing.md)")
    rt.add_argument("--drain-timeout", type=nonneg_float, default=5.0,
                    help="SIGTERM: the process is gone this + 3 s later at most")
    rt.add_argument("--local-stall-steps", type=nonneg_float, default=None, metavar="N",
                    help="auto mode: a local prefill may stall the decode worker's running streams for at most N of "
                         "their steps while a prefill worker could take it (default 4; 0: no cap; docs/routing.md)")
    rt.add_argument("--weights", type=weights_arg, default=None, metavar="K=V,...",
                    help="spread/price/fairness weights, e.g. zone=0.05,node=0.02,price=0,fairness=0 "
                         "(docs/routing.md, 'Failure domains, price and fairness')")
    _add_security(rt.add_argument_group("internal security"))


def _add_worker(sub) -> None:
    wk = sub.add_parser("worker", env=True, help="engine worker: --role prefill|decode|both")
    _add_common(wk)
    wk.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    wk.add_argument("--port", type=port, default=7100)
    wk.add_argument("--advertise-host", help="address peers use (default --host)")
    wk.add_argument("--worker-id")
    wk.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    wk.add_argument("--metrics-port", type=port, default=0)
    wk.add_argument("--heartbeat-ttl", type=positive_float, default=3.0)
    wk.add_argument("--lease-ttl", type=positive_float, default=30.0,
                    help="seconds pinned prefill KV waits for a decode worker to pull it")
    wk.add_argument("--transfer-timeout", type=positive_float, default=10.0)
    wk.add_argument("--drain-timeout", type=nonneg_float, default=30.0)
    wk.add_argument("--switch-handoff", choices=("drain", "migrate"), default="drain",
                    help="a role switch's streams: finished here first, or handed to the gateway's mid-stream "
                         "migration (resumed on another worker: re-prefilled there; docs/planner.md)")
    wk.add_argument("--labels", type=labels_arg, default={}, metavar="K=V,...",
                    help="failure domains and price for the router, e.g. zone=a,node=n1,price=2 (docs/routing.md)")
    add_engine(wk.add_argument_group("engine"))
    _add_grammar(wk.add_argument_group("guided output"), worker=True)
    _add_security(wk.add_argument_group("internal security"))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    prog = f"pdserve {args.command}"
    try:
        sys.exit(_run(args))
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # SystemExit passes through; anything else is one line unless -v
        print_error(prog, e, getattr(args, "verbose", False))
        sys.exit(1)


def _check_security(args: argparse.Namespace) -> str | None:
    """Read the secret files once up front: a wrong combination or an unusable file is one line, before any start."""
    from pdserve.services.internal_security import ConfigError, InternalSecurity
    from pdserve.services.redis_conn import RedisAuth
    try:
        InternalSecurity.from_args(args)
        auth = RedisAuth.from_args(args)
        # `up` without --redis-url starts a plain redis:// server of its own
        url = getattr(args, "redis_url", None) or ("redis://127.0.0.1/0" if args.command == "up" else None)
        if url:
            auth.check(url)
    except ConfigError as e:
        return str(e)
    return None


def _check_exposure(args: argparse.Namespace) -> str | None:
    from pdserve.services.internal_security import exposure_problem
    return exposure_problem(args.command, args.host, _security(args), bool(args.insecure_internal))


def _warn_open(command: str, security) -> None:
    import logging

    from pdserve.services.internal_security import open_warning
    text = open_warning(command, security)
    if text is not None:
        logging.getLogger("pdserve.security").warning(text)


def _security(args):
    from pdserve.services.internal_security import InternalSecurity
    return InternalSecurity.from_args(args)


def _redis_auth(args):
    from pdserve.services.redis_conn import RedisAuth
    return RedisAuth.from_args(args)


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "served_model_name", "x") is None:
        args.served_model_name = _default_served_name(args.model)
    if hasattr(args, "func"):  # generate / bench / sim: plain warnings (the services configure logs.py)
        import logging
        if getattr(args, "command", None) == "bench":  # the break-even study's predictions come from sim
            from pdserve.bench import breakeven
            from pdserve.sim import breakeven_predict
            breakeven.PREDICTOR = breakeven_predict
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return args.func(args) or 0
    problem = _check_security(args) or _check_exposure(args)
    if problem is not None:
        print(f"pdserve {args.command}: {problem}", file=sys.stderr)
        return 2
    if args.command == "up":
        from pdserve.services import logs
        from pdserve.services.up import up
        # up's own lines never block it (its children write to the same pipe through their own log queues)
        sys.stdout, sys.stderr = logs.QueuedStream(sys.stdout), logs.QueuedStream(sys.stderr)
        if args.planner:  # the planner sits above the services: `up` is handed its start, never imports it
            from pdserve.planner.connectors.local import start_in_up
            return up(args, start_planner=start_in_up)
        return up(args)
    if args.command in ("gateway", "worker"):  # both load the model: a wrong --model is one line, at once
        from pdserve.services.preflight import check_model
        problem = check_model(args.model)
        if problem is not None:
            print(f"pdserve {args.command}: {problem}", file=sys.stderr)
            return 2
    from pdserve.services import logs, tracing
    role = args.role if args.command == "worker" else None
    logs.setup(args.command, args.log_format, worker_role=role)
    tracing.setup(args.command, worker_role=role)  # only when OTEL_* ask for it (docs/observability.md)
    from pdserve.services.grpc_util import configure
    security = _security(args)
    configure(security)
    _warn_open(args.command, security)
    if args.command == "gateway":
        from pdserve.services.gateway.server import serve
        asyncio.run(serve(args))
    elif args.command == "router":
        from pdserve.services.router.server import serve
        asyncio.run(serve(args.host, args.port, args.redis_url, args.served_model_name, args.metrics_port,
                          args.heartbeat_ttl, args.mode, args.metrics_compat,
                          security=security, redis_auth=_redis_auth(args), drain_s=args.drain_timeout,
                          weights=args.weights, placement=args.placement,
                          local_stall_steps=args.local_stall_steps))
    elif args.command == "worker":
        from pdserve.services.worker import serve
        asyncio.run(serve(args))
    else:
        raise SystemExit(f"unknown command {args.command}")
    return 0


if __name__ == "__main__":
    main()
