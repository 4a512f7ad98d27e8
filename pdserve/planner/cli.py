"""`pdserve planner` (its own process: the chart's planner Deployment) and `pdserve status` (docs/planner.md). The
planner flags it shares with `pdserve up --planner` are in cli_flags.py. Flags read PDSERVE_<FLAG> like every
service's."""
from __future__ import annotations

import asyncio
import sys

from pdserve.cli_args import port, positive_float
from pdserve.cli_flags import add_planner_flags, add_security, check_limits


def add_planner_parser(sub) -> None:
    p = sub.add_parser("planner", env=True, help="SLA planner: size the prefill and decode pools from measured load")
    p.add_argument("--model", default="builtin", help="the served model (names its registry keys)")
    p.add_argument("--served-model-name", help="default: the model dir's basename")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the deployment's registry")
    p.add_argument("--metrics-url", action="append", default=None,
                   help="a /metrics page to read (the gateway's; repeat for workers): e.g. "
                        "http://rel-pdserve-gateway:9090/metrics")
    p.add_argument("--connector", choices=["kubernetes", "registry"], default="kubernetes",
                   help="kubernetes: patch the Deployments' scale; registry: read-only (needs --dry-run)")
    p.add_argument("--namespace", default=None, help="the Deployments' namespace (default: the pod's)")
    p.add_argument("--prefill-deployment", default="pdserve-prefill")
    p.add_argument("--decode-deployment", default="pdserve-decode")
    p.add_argument("--flex-selector", default=None, help="label selector of the pods that may switch role (the "
                   "chart's flex pool); the planner moves them between the pools before scaling (docs/planner.md)")
    p.add_argument("--flex-port", type=port, default=50051, help="the flex pods' worker gRPC port")
    p.add_argument("--drain-timeout", type=positive_float, default=30.0,
                   help="seconds a switching worker may drain its old role's work")
    p.add_argument("--kubeconfig", default=None, help="outside a pod (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--costs", default=None, help="`pdserve sim profile` JSON: the cost model before live numbers")
    p.add_argument("--dry-run", action="store_true", help="only log and export the decisions")
    p.add_argument("--metrics-port", type=port, default=0, help="serve the planner's /metrics here (0: off)")
    p.add_argument("--host", default="0.0.0.0", help="address of --metrics-port")
    p.add_argument("--heartbeat-ttl", type=positive_float, default=3.0, help="the workers' (registry record TTL)")
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    add_planner_flags(p)
    add_security(p)
    p.set_defaults(func=cmd_planner)


def _namespace(a) -> str:
    if a.namespace:
        return a.namespace
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip()
    except OSError:
        return "default"


def cmd_planner(a) -> int:
    import threading

    from pdserve.planner.loop import Planner, PlannerConfig
    from pdserve.services import logs
    from pdserve.services.metrics import exposition
    from pdserve.services.metrics.planner import PLANNER
    from pdserve.services.procutil import install_stop_signals
    problem = check_limits(a)
    if problem is None and a.connector == "registry" and not a.dry_run:
        problem = "--connector registry only reads the pools: add --dry-run"
    if problem is None and not a.metrics_url:
        problem = "--metrics-url: give the gateway's /metrics (at least)"
    if problem:
        print(f"pdserve planner: {problem}", file=sys.stderr)
        return 2
    logs.setup("planner", a.log_format)
    if a.connector == "kubernetes":
        from pdserve.planner.connectors.kubernetes import KubernetesConnector
        if a.flex_selector:  # role switches call the flex pods' SwitchRole: authenticated like every internal RPC
            from pdserve.services.grpc_util import configure
            from pdserve.services.internal_security import InternalSecurity
            configure(InternalSecurity.from_files(a.internal_token_file, a.tls_cert, a.tls_key, a.tls_ca,
                                                  a.tls_server_name))
        conn = KubernetesConnector(_namespace(a), {"prefill": a.prefill_deployment, "decode": a.decode_deployment},
                                   kubeconfig=a.kubeconfig, flex_selector=a.flex_selector, flex_port=a.flex_port,
                                   drain_timeout_s=a.drain_timeout)
    else:
        from pdserve.planner.connectors.registry import RegistryConnector
        conn = RegistryConnector()
    if a.metrics_port:
        exposition.serve(exposition.exposition(PLANNER, {"model": a.served_model_name}), a.metrics_port, a.host)
    planner = Planner(PlannerConfig.from_args(a), conn, lambda: list(a.metrics_url))
    stop = threading.Event()

    async def main():
        signalled = install_stop_signals()
        task = asyncio.create_task(planner.run(stop))
        await signalled.wait()
        stop.set()
        await task

    asyncio.run(main())
    return 0


def add_status_parser(sub) -> None:
    p = sub.add_parser("status", help="pools, workers (role, load, health) and the planner's last decision")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help="a gateway (its /status; default: the local `pdserve up`)")
    where.add_argument("--redis-url", help="read the deployment's registry directly")
    p.add_argument("--model", default=None, help="served model name (with --redis-url; default: the only one)")
    p.add_argument("--api-key", default=None, help="with --url, a key with the metrics permission (env "
                                                     "PDSERVE_API_KEY)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--internal-token-file", help="verify the registry's signed records (with --redis-url)")
    p.add_argument("--redis-password-file")
    p.add_argument("--redis-ca-file")
    p.set_defaults(func=cmd_status)


def cmd_status(a) -> int:
    from pdserve.services.status import format_text, gather
    st = gather(a)
    if st is None:
        return 1
    print(__import__("json").dumps(st, indent=2) if a.json else format_text(st))
    return 0
