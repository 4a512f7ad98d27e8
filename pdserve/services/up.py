"""`pdserve up`: a whole local deployment as separate processes.

Order: Redis (private `redis-server` found on PATH unless --redis-url), router, workers, gateway; then wait for
the gateway's /health (all roles registered) and print the base URL plus one machine-readable line
`PDSERVE_UP {json}` (pids, ports, metrics ports: what tests and scripts need). Ctrl-C / SIGTERM stops all in
reverse order (SIGTERM, which drains, then SIGKILL after a grace period). A child that dies before the deployment
is ready fails `up`; once ready, a child that exits is restarted with backoff (supervisor.py: counted, logged,
announced as `PDSERVE_CHILD {json}`), unless --no-restart, with which a dead gateway, router or Redis, or the last
worker, stops everything. Children never outlive `up` (parent-death signal, supervisor.py).

Closed by default (docs/services.md, Trust model): unless given them, `up` generates an internal token and a
password for its private Redis, each a 0600 file in a 0700 directory under the state dir (removed when `up`
stops), and passes their paths to every child like the user's own files; PDSERVE_UP and the state file name them
for local clients (`pdserve status`, tests, bench). `--insecure-internal` generates nothing and says at WARNING
what is open; so does a user's --redis-url without a password.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from pdserve.cli_flags import engine_argv
from pdserve.services.ports import free_port, hand_out
from pdserve.services.supervisor import Child, Supervisor, describe_exit

ROOT = str(Path(__file__).resolve().parent.parent.parent)


def _wait_tcp(port: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


LIFECYCLE_FLAGS = ("api_keys_file", "max_body_bytes", "default_timeout", "max_timeout", "admission_queue",
                   "max_queue_wait", "kv_overcommit", "reservation_lease", "tool_call_parser",
                   "default_max_tokens", "max_logprob_entries", "migration_limit", "allowed_hosts", "allowed_origins",
                   "require_disagg")


# Paths only: the secrets stay in their files (a child's command line is visible to every local user).
SECURITY_FLAGS = ("internal_token_file", "tls_cert", "tls_key", "tls_ca", "tls_server_name", "redis_password_file",
                  "redis_ca_file")


def _flags(args, names) -> list[str]:
    out = []
    for name in names:
        v = getattr(args, name, None)
        if isinstance(v, tuple):  # a list flag (--allowed-hosts): as it was given, or not at all when empty
            v = ",".join(v) or None
        if isinstance(v, bool):  # a switch (--require-disagg): present or not
            out += ["--" + name.replace("_", "-")] if v else []
        elif v is not None:
            out += ["--" + name.replace("_", "-"), str(v)]
    return out


def _lifecycle_flags(args) -> list[str]:
    return _flags(args, LIFECYCLE_FLAGS)


def _grammar_flags(args, worker: bool) -> list[str]:
    """Guided-output limits (engine/grammar_limits.py): the gateway refuses over them, workers check again."""
    from pdserve.engine.grammar_limits import LIMIT_FLAGS
    out = []
    for flag, (attr, _) in LIMIT_FLAGS.items():
        if getattr(args, attr, None) is not None:
            out += [flag, str(getattr(args, attr))]
    if worker and getattr(args, "grammar_processes", None) is not None:
        out += ["--grammar-processes", str(args.grammar_processes)]
    if worker and getattr(args, "grammar_start", None) is not None:
        out += ["--grammar-start", args.grammar_start]
    return out


def _warn(text: str) -> None:
    print(f"pdserve up: WARNING: {text}", file=sys.stderr, flush=True)


def _secret_file(path: Path) -> str:
    # created 0600 from the start (O_EXCL: never someone else's file), not chmod-ed after being written
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return str(path)


def _secrets_dir() -> Path:
    from pdserve.services.status import state_dir
    try:
        state_dir().mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"secrets-{os.getpid()}-", dir=state_dir()))  # 0700
    except OSError:
        return Path(tempfile.mkdtemp(prefix="pdserve-secrets-"))  # a state dir we cannot write: the temp dir


def _open_parts(args) -> list[str]:
    parts = []
    if not args.internal_token_file and not args.tls_ca:
        parts.append("router and worker RPCs answer any local caller and worker registry records are unsigned (a "
                     "process that can write to Redis can register a worker and receive prompts)")
    if not args.redis_password_file and not (args.redis_url and urlparse(args.redis_url).password):
        parts.append("Redis has no password (whoever reaches it can read and change the registry, the admission "
                     "ledger, rate limits and quotas)")
    return parts


def close_by_default(args) -> Path | None:
    """Fill in the internal token and the private Redis' password `args` lacks (generated files); the directory
    holding them, or None when nothing was generated. Warns about what stays open."""
    if args.insecure_internal:
        _warn("--insecure-internal: " + "; ".join(_open_parts(args) or ["nothing generated"]))
        return None
    need_token = not args.internal_token_file
    need_password = not args.redis_url and not args.redis_password_file
    d = _secrets_dir() if need_token or need_password else None
    if need_token:
        args.internal_token_file = _secret_file(d / "internal-token")
    if need_password:
        args.redis_password_file = _secret_file(d / "redis-password")
    if args.redis_url and _open_parts(args):  # a user's Redis without a password stays the user's choice
        _warn(f"--redis-url {args.redis_url.split('@')[-1]}: " + "; ".join(_open_parts(args)))
    return d


# `--planner`: starts the planner in this process once the deployment is ready, given the supervisor, the
# `start_worker(role)` that grows a pool and the PDSERVE_UP record; returns what `up` calls `start()` once,
# `apply()` every tick (from this, the forking thread) and `stop()` before its children stop
# (planner/connectors/local.py: start_in_up). Passed in by cli.py: services never import the planner.
StartPlanner = Callable[[Any, Supervisor, Callable[[str], Child], dict], Any]


def up(args, start_planner: StartPlanner | None = None) -> int:
    problem = _preflight(args, start_planner)
    if problem is not None:
        print(f"pdserve up: {problem}", file=sys.stderr, flush=True)
        return 2
    # the ports given on the command line are taken (the gateway binds them last): never hand them to a child
    hand_out(p for p in (args.port, args.grpc_port) if p)
    d = Supervisor(_env(), restart=False)  # restarting starts once the deployment is ready
    pdserve = [sys.executable, "-m", "pdserve"]
    planner = None
    stopping = {"flag": False}
    generated = close_by_default(args)
    capped, capped_names = _capper(args)

    def on_signal(signum, frame):
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        redis_url = args.redis_url or _start_redis(d, args)
        if redis_url is None:
            print("pdserve up: redis-server did not start", file=sys.stderr)
            return 1
        common = _common_flags(args)
        # every engine flag given, as given (cli_flags.ENGINE_FLAGS); the TP degree is per role, below
        eng = engine_argv(args, skip=("tensor_parallel_size", "expert_parallel_size"))
        routers = _start_routers(d, args, [*pdserve, "router", *common], redis_url)
        roles, tp, ep = _pools(args)
        if not args.threads:  # split the host's cores between the ranks rather than oversubscribe them
            eng += ["--threads", str(_default_threads(args, roles, tp, ep))]
        if (args.device or "cpu") == "cpu":
            _build_kernels_once(d)
        started = iter(range(1 << 30))

        def start_worker(role: str) -> Child:
            i, port, mport = next(started), free_port(), free_port()
            wid = f"{role}-{i}-{port}"
            argv = [*pdserve, "worker", *common, *eng, "--role", role,
                    "--tensor-parallel-size", str(tp[role]), "--expert-parallel-size", str(ep[role]),
                    "--port", str(port), "--worker-id", wid,
                    "--redis-url", redis_url, "--metrics-port", str(mport),
                    "--heartbeat-ttl", str(args.heartbeat_ttl), "--lease-ttl", str(args.lease_ttl),
                    *_grammar_flags(args, worker=True), *_worker_flags(args)]
            return d.start(wid, capped(wid, argv), {"role": role, "port": port, "metrics_port": mport,
                                                    "worker_id": wid})

        for role in roles:
            start_worker(role)
        base = _start_gateway(d, args, [*pdserve, "gateway", *common], routers, redis_url)
        if not _wait_ready(d, base, roles, time.monotonic() + args.ready_timeout, stopping):
            return 1
        print(f"pdserve up: {args.mode} deployment of {args.served_model_name} ready at {base}/v1", flush=True)
        ready_info = {"base_url": base, "mode": args.mode, "redis_url": redis_url, "model": args.served_model_name,
                      "internal_token_file": args.internal_token_file,
                      "redis_password_file": args.redis_password_file, "processes": d.infos()}
        if args.planner:  # the planner adds and drains workers through start_worker (docs/planner.md)
            planner = start_planner(args, d, start_worker, ready_info)
        _announce(ready_info)
        d.restart = not args.no_restart
        if planner is not None:
            planner.start()
        return _supervise(d, planner, stopping)
    finally:
        _stop(d, planner, generated, args.drain_timeout)
        if capped_names:
            from pdserve.services.cpu_share import remove_groups
            remove_groups(capped_names)


def _preflight(args, start_planner: StartPlanner | None) -> str | None:
    """Everything that can be known wrong before a process starts, in one line and well under a second, rather
    than as a child's traceback seconds later; None when nothing is."""
    from pdserve.services.preflight import check_up
    problem = check_up(args)
    if problem is None and args.planner and start_planner is None:
        problem = "--planner: no planner was handed to `up` (pdserve/cli.py hands it one)"
    return problem


def _announce(ready_info: dict) -> None:
    """The deployment is ready: remembered for `pdserve status`, and the PDSERVE_UP line on stdout."""
    from pdserve.services.status import remember_local
    remember_local(ready_info)
    # one write: another thread's log line (stderr, often the same pipe) cannot land inside it
    sys.stdout.write("PDSERVE_UP " + json.dumps(ready_info) + "\n")
    sys.stdout.flush()


def _stop(d: Supervisor, planner, generated: Path | None, drain_timeout: float | None) -> None:
    """The planner first (nothing is started or drained after it stops), then the children, then the secrets
    `up` generated (after the children: a restarting one still reads them)."""
    if planner is not None:
        planner.stop()
    from pdserve.services.status import forget_local
    forget_local()
    d.stop_all(drain_timeout + 5 if drain_timeout is not None else 15.0)
    if generated is not None:
        shutil.rmtree(generated, ignore_errors=True)
    print("pdserve up: stopped", flush=True)


def _start_routers(d: Supervisor, args, argv: list[str], redis_url: str) -> list[str]:
    """The routers (`argv`: `pdserve router` and the common flags), active-active: each reads the registry and the
    KV events itself, and the gateway fails over between them. Their addresses."""
    routers = []
    for i in range(args.routers):
        rt_port, rt_metrics = free_port(), free_port()
        d.start("router" if i == 0 else f"router-{i}",
                [*argv, "--port", str(rt_port), "--redis-url", redis_url,
                 "--metrics-port", str(rt_metrics), "--heartbeat-ttl", str(args.heartbeat_ttl),
                 "--mode", args.mode, "--placement", args.placement],
                {"port": rt_port, "metrics_port": rt_metrics})
        routers.append(f"127.0.0.1:{rt_port}")
    return routers


def _pools(args) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """The workers' roles, one entry per worker, and each role's tensor- and expert-parallel degree. auto and
    disagg deploy the same two pools; the router's policy differs (a decode worker also answers Generate, so in
    auto it prefills short prompts itself)."""
    roles = (["prefill"] * args.prefill + ["decode"] * args.decode) if args.mode in ("auto", "disagg") \
        else ["both"] * args.workers
    tp = {"prefill": args.prefill_tp, "decode": args.decode_tp}
    tp = {r: tp.get(r) or args.tensor_parallel_size or 1 for r in set(roles)}
    ep = {"prefill": getattr(args, "prefill_ep", None), "decode": getattr(args, "decode_ep", None)}
    ep = {r: ep.get(r) or args.expert_parallel_size or 1 for r in set(roles)}
    return roles, tp, ep


def _start_gateway(d: Supervisor, args, argv: list[str], routers: list[str], redis_url: str) -> str:
    """The gateway (`argv`: `pdserve gateway` and the common flags), the one process clients reach: it listens on
    --host (the rest stay on loopback). The base URL clients use."""
    gport = args.grpc_port or free_port()
    d.start("gateway", [*argv, "--host", args.host, "--port", str(args.port),
                        "--grpc-port", str(gport), "--router", ",".join(routers), "--redis-url", redis_url,
                        *_lifecycle_flags(args), *_grammar_flags(args, worker=False)],
            {"port": args.port, "grpc_port": gport})
    reach = "127.0.0.1" if args.host in ("0.0.0.0", "", "::") else args.host
    return f"http://{'[' + reach + ']' if ':' in reach else reach}:{args.port}"


def _start_redis(d: Supervisor, args) -> str | None:
    """up's private redis-server (nothing persisted: the registry is soft state); its URL, None if it did not
    start. With a password file it takes the password through its stdin (`-`), not its command line."""
    binary = shutil.which("redis-server")  # preflight made sure there is one
    rport = free_port()
    cmd = [binary, "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--loglevel", "warning"]
    stdin_data = None
    if args.redis_password_file:
        cmd.insert(1, "-")
        pw = Path(args.redis_password_file).read_text().strip().replace("\\", "\\\\").replace('"', '\\"')
        stdin_data = f'requirepass "{pw}"\n'.encode()
    d.start("redis", cmd, {"port": rport}, stdin_data=stdin_data, relay=True)
    return f"redis://127.0.0.1:{rport}/0" if _wait_tcp(rport, 10) else None


def _common_flags(args) -> list[str]:
    """What every child gets: the model, the log format, the security files, metrics compat, drain timeout."""
    common = ["--model", args.model, "--served-model-name", args.served_model_name,
              "--log-format", args.log_format, *_flags(args, SECURITY_FLAGS)]
    if args.metrics_compat:
        common += ["--metrics-compat", args.metrics_compat]
    if args.drain_timeout is not None:
        common += ["--drain-timeout", str(args.drain_timeout)]
    return common


def _default_threads(args, roles, tp, ep) -> int:
    """Torch threads per rank: a capped worker's own CPUs (`--worker-cpus`), else the host's cores split between
    the ranks rather than oversubscribed."""
    if getattr(args, "worker_cpus", None):
        return max(1, round(args.worker_cpus))
    return max(1, (os.cpu_count() or 1) // max(1, sum(max(tp[r], ep[r]) for r in roles)))


def _capper(args) -> tuple[Callable[[str, list[str]], list[str]], list[str]]:
    """(`capped(name, argv)`, the names it capped): a worker's command capped at `--worker-cpus` in a cgroup of its
    own where that is given (`up` removes the groups once its children stop), the command as it is otherwise."""
    cores = getattr(args, "worker_cpus", None)
    names: list[str] = []
    if not cores:
        return (lambda name, argv: argv), names
    from pdserve.services import cpu_share

    def capped(name: str, argv: list[str]) -> list[str]:
        names.append(name)
        return cpu_share.wrap(argv, name, cores)
    return capped, names


def _worker_flags(args) -> list[str]:
    """What every worker (not the gateway or router) gets on top of the common flags."""
    handoff = getattr(args, "switch_handoff", None)
    return ["--switch-handoff", handoff] if handoff else []


def _build_kernels_once(d: Supervisor) -> None:
    """Build the engine's native kernels once, here, rather than in every worker at the same time (they would
    serialize on the build lock inside their start-up); a no-op once cached. Bounded by
    PDSERVE_KERNEL_BUILD_TIMEOUT; when they are unavailable (said once, by the child) the workers skip them
    instead of each trying, and waiting, again. Already built (the usual start): no child, which would spend ~1 s
    importing torch to find that out."""
    from pdserve.engine.kernels import native_ready
    if not native_ready() and subprocess.run(
            [sys.executable, "-c", "import sys; from pdserve.engine.kernels import native_ops; "
             "sys.exit(native_ops() is None)"], env=d.env, check=False).returncode != 0:
        d.env["PDSERVE_NATIVE_KERNELS"] = "0"


def _wait_ready(d: Supervisor, base: str, roles: list[str], end: float, stopping: dict) -> bool:
    """Until the gateway's /health sees every worker this command started (not merely one of each role); False
    when a child died, the deadline passed or a signal came (each said on stderr but the signal)."""
    while time.monotonic() < end and not stopping["flag"]:
        d.poll()
        dead = d.dead()
        if dead:
            print(f"pdserve up: {dead.name} exited with {describe_exit(dead.proc.returncode)}", file=sys.stderr)
            return False
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                seen = json.loads(r.read()).get("workers", {})
                if r.status == 200 and all(seen.get(role, 0) >= roles.count(role) for role in set(roles)):
                    return True
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    if not stopping["flag"]:
        print("pdserve up: not healthy before --ready-timeout", file=sys.stderr)
    return False


def _supervise(d: Supervisor, planner, stopping: dict) -> int:
    """Restart children as they exit (the Supervisor), apply the planner's scaling; until a signal (0), or,
    with --no-restart, until the last worker or the gateway, router or Redis died (1)."""
    while not stopping["flag"]:
        if planner is not None:
            planner.apply()  # its scaling requests: children are forked from this thread only (supervisor.py)
        d.poll()
        dead = d.dead()  # only with --no-restart
        if dead and not any(c.info.get("role") and c.running for c in d.children.values()):
            print(f"pdserve up: {dead.name} died; no workers left, stopping", file=sys.stderr)
            return 1
        routers_up = any(n.startswith("router") and c.running for n, c in d.children.items())
        if dead and (not routers_up or any(n in ("gateway", "redis") and not c.running
                                           for n, c in d.children.items())):
            print(f"pdserve up: {dead.name} died; stopping", file=sys.stderr)
            return 1
        time.sleep(0.2)
    return 0
