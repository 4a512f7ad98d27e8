"""`pdserve worker-role WORKER ROLE`: ask one worker to change role (its SwitchRole RPC; services/role_switch.py).

WORKER is a worker id of the local `pdserve up` (as `pdserve status` lists it) or a gRPC address host:port. The
call is authenticated like every internal RPC: the internal token of the local `up` (or --internal-token-file,
and the TLS files of a deployment that uses mTLS). Prints the worker's answer: the role it serves now, the time
from the request to serving in it, and how long the drain took.
"""
from __future__ import annotations

import asyncio
import json
import sys


def add_worker_role_parser(sub) -> None:
    p = sub.add_parser("worker-role", help="switch a worker's role (prefill, decode, both) in its process")
    p.add_argument("worker", help="a worker id of the local `pdserve up`, or a worker's gRPC address host:port")
    p.add_argument("role", choices=("prefill", "decode", "both"))
    p.add_argument("--drain-timeout", type=float, default=0.0,
                   help="seconds to wait for the old role's work (default: the worker's --drain-timeout)")
    p.add_argument("--handoff", choices=("migrate", "drain"), default="",
                   help="its streams: resumed elsewhere by the gateway's migration, or finished here first "
                        "(default: the worker's --switch-handoff)")
    p.add_argument("--internal-token-file", help="default: the local `pdserve up`'s")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--tls-ca")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_worker_role)


def resolve(worker: str, token_file: str | None) -> tuple[str, str | None]:
    """(address, token file): a local `up`'s worker id -> its port; an address as given."""
    from pdserve.services.status import find_local
    local = find_local()
    if local is not None:
        token_file = token_file or local.get("internal_token_file")
        for p in local.get("processes", ()):
            if p.get("worker_id") == worker:
                return f"127.0.0.1:{p['port']}", token_file
    if ":" not in worker:
        raise SystemExit(f"pdserve worker-role: no worker {worker!r} in a local `pdserve up`; give host:port")
    return worker, token_file


async def switch(address: str, role: str, drain_timeout_s: float = 0.0, timeout_s: float = 300.0,
                 handoff: str = ""):
    """One SwitchRole call on the configured internal channel (grpc_util.configure first)."""
    from pdserve.services.grpc_util import channel
    from pdserve.services.pb import worker_pb2, worker_pb2_grpc
    ch = channel(address)
    try:
        return await worker_pb2_grpc.WorkerStub(ch).SwitchRole(
            worker_pb2.SwitchRoleRequest(role=role, drain_timeout_s=drain_timeout_s, handoff=handoff),
            timeout=timeout_s)
    finally:
        await ch.close()


def cmd_worker_role(a) -> int:
    import grpc

    from pdserve.services.grpc_util import configure
    from pdserve.services.internal_security import InternalSecurity
    address, token_file = resolve(a.worker, a.internal_token_file)
    configure(InternalSecurity.from_files(token_file, a.tls_cert, a.tls_key, a.tls_ca))
    try:
        r = asyncio.run(switch(address, a.role, a.drain_timeout, handoff=a.handoff))
    except grpc.aio.AioRpcError as e:
        print(f"pdserve worker-role: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    out = {"worker": a.worker, "old_role": r.old_role, "role": r.role, "switched": r.switched,
           "seconds": round(r.seconds, 4), "drain_s": round(r.drain_s, 4), "drained_requests": r.drained_requests,
           "error": r.error, "handoff": r.handoff, "handed_off": r.handed_off}
    if a.json:
        print(json.dumps(out))
    elif r.switched:
        print(f"{a.worker}: {r.old_role} -> {r.role} in {r.seconds:.3f} s (drain {r.drain_s:.3f} s, "
              f"{r.drained_requests} held, {r.handed_off} stream(s) handed off)")
    else:
        print(f"{a.worker}: still {r.role}: {r.error}")
    return 0 if r.switched or r.error.startswith("already") else 1
