"""`pdserve up`'s checks before it starts anything: the model, the ports, Redis, the worker counts.

Each failed check is one `Problem`: what is wrong and what to do, printed as one line, so a wrong path or a busy
port costs a fraction of a second instead of a start that fails in four processes with a traceback each. Nothing
here imports torch (an `up` with a bad flag answers in well under a second).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from pdserve.engine.architectures import SUPPORTED_ARCHITECTURES
from pdserve.services.ports import free_port

# owner/name as the Hugging Face hub spells a repository (what people pass to --model out of habit)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True)
class Problem:
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}; {self.fix}"


def check_model(model: str) -> Problem | None:
    if model == "builtin":
        from pdserve.builtin import builtin_model_dir
        try:
            builtin_model_dir()
        except FileNotFoundError as e:
            return Problem(str(e).split(". ")[0], "reinstall pdserve, or pass --model <checkpoint dir>")
        return None
    path = Path(model).expanduser()
    if not path.exists():
        if _HUB_ID.match(model):
            local = "./" + model.split("/", 1)[1]
            return Problem(f"--model {model}: no such directory, and it looks like a Hugging Face hub id "
                           "(pdserve has no hub access and downloads nothing)",
                           f"download it first (e.g. `huggingface-cli download {model} --local-dir {local}`) and "
                           f"pass the directory: --model {local}")
        return Problem(f"--model {model}: no such directory",
                       "pass a checkpoint directory (config.json, tokenizer.json, *.safetensors) or 'builtin'")
    if not path.is_dir():
        return Problem(f"--model {model}: a file, not a checkpoint directory",
                       "pass the directory that holds config.json, tokenizer.json and the *.safetensors weights")
    cfg = path / "config.json"
    if not cfg.is_file():
        return Problem(f"--model {model}: not a checkpoint directory (no config.json)",
                       "pass the directory that holds config.json, tokenizer.json and the *.safetensors weights")
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (ValueError, AttributeError) as e:
        return Problem(f"{cfg}: not a JSON object ({e})", "restore the checkpoint's config.json")
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        return Problem(f"{cfg}: unsupported architecture {archs[0] if archs else None!r}",
                       f"pdserve runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    if not (path / "tokenizer.json").is_file():
        return Problem(f"--model {model}: no tokenizer.json",
                       "save the tokenizer next to the weights (tokenizer.save_pretrained(dir) in transformers)")
    if not any((path / w).is_file() for w in _WEIGHTS):
        return Problem(f"--model {model}: no {' or '.join(_WEIGHTS)}",
                       "save the weights as safetensors (model.save_pretrained(dir, safe_serialization=True))")
    return None


def port_owner(port: int) -> str | None:
    """'pid 123 (redis-server)' for the process listening on `port`, when /proc says so (Linux, same user)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in wanted for fd in fds):
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                return f"pid {pid} ({comm})"
        except OSError:
            continue
    return None


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_port(flag: str, host: str, port: int) -> Problem | None:
    if port == 0 or port_free(host, port):
        return None
    owner = port_owner(port)
    return Problem(f"{flag} {port}: port {port} on {host} is already in use" + (f" by {owner}" if owner else ""),
                   f"stop that process or pass a free port (e.g. {flag} {free_port()})")


def redact_url(url: str) -> str:
    """The URL with its password (if any) replaced: error lines end up in logs."""
    u = urlparse(url)
    if not u.password:
        return url
    netloc = f"{u.username or ''}:***@{u.hostname}" + (f":{u.port}" if u.port else "")
    return u._replace(netloc=netloc).geturl()


def check_redis(redis_url: str | None) -> Problem | None:
    if not redis_url:
        if shutil.which("redis-server") is None:
            return Problem("redis-server not found on PATH (`up` starts a private one unless --redis-url is given)",
                           "install it (Debian: apt-get install redis-server) or pass --redis-url redis://HOST:PORT/0")
        return None
    u = urlparse(redis_url)
    shown = redact_url(redis_url)
    if u.scheme == "unix":
        if not Path(u.path).exists():
            return Problem(f"--redis-url {shown}: no socket at {u.path}", "start Redis or fix the path")
        return None
    if u.scheme not in ("redis", "rediss") or not u.hostname:
        return Problem(f"--redis-url {shown}: not a Redis URL", "use redis://HOST:PORT/DB (or rediss://, unix://)")
    try:
        port = u.port or 6379
    except ValueError:
        return Problem(f"--redis-url {shown}: bad port", "use redis://HOST:PORT/DB")
    try:
        socket.create_connection((u.hostname, port), timeout=1.0).close()
    except OSError as e:
        return Problem(f"--redis-url {shown}: nothing answers at {u.hostname}:{port} ({e.strerror or e})",
                       "start Redis there, or leave --redis-url out and `up` starts its own")
    return None


def check_up(args) -> Problem | None:
    """The first problem with `pdserve up`'s arguments and host, or None."""
    workers = (args.prefill + args.decode) if args.mode in ("auto", "disagg") else args.workers
    if workers == 0:
        flags = "--prefill and --decode are" if args.mode in ("auto", "disagg") else "--workers is"
        return Problem(f"no workers to start ({flags} 0)", "start at least one worker")
    if args.mode == "disagg" and (args.prefill == 0 or args.decode == 0):
        return Problem(f"--mode disagg needs both pools (--prefill {args.prefill}, --decode {args.decode})",
                       "give each pool at least one worker, or use --mode auto / colocated")
    if getattr(args, "planner", False):
        from pdserve.cli_flags import check_up_planner
        why = check_up_planner(args)
        if why:
            return Problem(why, "see docs/planner.md")
    if getattr(args, "worker_cpus", None):
        from pdserve.services.cpu_share import out_of_range, why_not
        why = why_not()
        if why:
            return Problem(f"--worker-cpus {args.worker_cpus}: {why}", "run as root, or leave --worker-cpus out")
        bad = out_of_range(args.worker_cpus)
        if bad:
            return Problem(f"--worker-cpus {bad}", "give each worker between 0.01 CPU and the machine's CPUs")
    if args.grpc_port and args.grpc_port == args.port:
        return Problem(f"--port and --grpc-port are both {args.port}", "give the gateway two different ports")
    return (check_model(args.model) or check_tp_degrees(args) or check_port("--port", args.host, args.port)
            or check_port("--grpc-port", args.host, args.grpc_port) or check_redis(args.redis_url))


def check_tp_degrees(args) -> Problem | None:
    """Tensor parallel sizes `up` would start workers with: the checkpoint's heads must split at each (spec D08,
    engine/tp/shard.py), said before any worker loads. The pools may differ (KV moves head slice by head slice
    between TP degrees: kv_transfer/tp_plan.py)."""
    base = getattr(args, "tensor_parallel_size", None) or 1
    ep_base = getattr(args, "expert_parallel_size", None) or 1
    if args.mode in ("auto", "disagg"):  # per pool: (TP flag, TP degree, EP flag, EP degree)
        pools = [("--prefill-tp", getattr(args, "prefill_tp", None) or base,
                  "--prefill-ep", getattr(args, "prefill_ep", None) or ep_base),
                 ("--decode-tp", getattr(args, "decode_tp", None) or base,
                  "--decode-ep", getattr(args, "decode_ep", None) or ep_base)]
    else:
        pools = [("--tensor-parallel-size", base, "--expert-parallel-size", ep_base)]
    for flag, n, ep_flag, ep in pools:
        if ep not in (1, n) and n != 1:
            return Problem(f"{ep_flag} {ep} with {flag} {n}: a pool's expert parallel size is 1, its tensor parallel "
                           f"size (experts split over the tensor-parallel ranks) or any size with {flag} 1 "
                           f"(attention replicated on every rank)", f"give that pool {flag} {ep} or 1, or {ep_flag} 1")
    degrees = {flag: (n, ep > 1) for flag, n, _, ep in pools if n > 1}
    replicated = {ep_flag: ep for flag, n, ep_flag, ep in pools if n == 1 and ep > 1}
    if not degrees and not replicated:
        return None
    from pdserve.engine.checkpoint import read_config, resolve_model_dir
    from pdserve.engine.errors import CheckpointError
    from pdserve.engine.tp.shard import check_tp
    try:
        _, cfg, _ = read_config(resolve_model_dir(args.model))
        heads = int(cfg["num_attention_heads"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        for ep_flag, ep in replicated.items():
            if not experts:
                return Problem(f"{ep_flag} {ep}: the model has no routed experts to split", f"{ep_flag} 1")
            if experts % ep:
                return Problem(f"{ep_flag} {ep}: the model's {experts} routed experts cannot be split whole over "
                               f"{ep} ranks", f"an expert parallel size that divides {experts}, or {ep_flag} 1")
        for flag, (n, expert_parallel) in degrees.items():
            try:
                check_tp(heads, int(cfg.get("num_key_value_heads") or heads), int(cfg["intermediate_size"]), n,
                         experts, expert_parallel)
            except CheckpointError as e:
                return Problem(f"{flag} {n}: {e}", "choose a size the model's heads divide by (spec D08), 1 for an "
                               "MoE model")
    except (KeyError, TypeError, ValueError):
        return None  # a malformed config is the engine's to report, in its own words
    return None
