"""`pdserve status`: the deployment's pools, each worker's role, load and health, and the planner's last decision.

Where from:
- `--redis-url URL`: the registry itself (services/registry.py; records whose HMAC does not verify under
  `--internal-token-file` are left out, as the router leaves them out) and the planner's record (decision.py);
- `--url GATEWAY`: the gateway's `/status` (the router's view of the registry and the planner's record as the
  gateway reads them; the same permission as /metrics when keys are on);
- neither: the local `pdserve up`, which leaves `up-<pid>.json` (its redis URL, model, token file path) in
  $PDSERVE_STATE_DIR (default ~/.cache/pdserve) while it runs; the newest whose process is alive is used.

A worker is `healthy` when its registry record is live: signed (when a token is configured) and heartbeated
within the TTL (a draining worker leaves the registry first, a dead one lapses).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.planner import decision

log = logging.getLogger("pdserve.status")
POOL_ORDER = ("prefill", "decode", "both")


def state_dir() -> Path:
    return Path(os.environ.get("PDSERVE_STATE_DIR") or Path.home() / ".cache" / "pdserve")


def remember_local(info: dict) -> Path | None:
    """`up`, once ready: where `pdserve status` finds it (paths and URLs only, no secret)."""
    try:
        d = state_dir()
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"up-{os.getpid()}.json"
        # the planner rewrites this at every change while `pdserve status` may be reading it: write a sibling and
        # rename it over (atomic on POSIX), so a reader sees the old record or the new one, never a truncated file
        tmp = d / f".up-{os.getpid()}.json.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, p)
        return p
    except OSError:
        return None  # status then needs --url / --redis-url; serving does not depend on this file


def forget_local() -> None:
    (state_dir() / f"up-{os.getpid()}.json").unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_local() -> dict | None:
    files = sorted(state_dir().glob("up-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for f in files:
        try:
            info = json.loads(f.read_text())
            if _alive(int(f.stem.split("-", 1)[1])):
                return info
        except (OSError, ValueError):
            continue
    return None


def _worker(rec_id: str, role: str, address: str, ld, updated: float | None) -> dict:
    total = ld.kv_blocks_total
    return {"id": rec_id, "role": role, "healthy": True, "address": address,
            "age_s": None if updated is None else round(max(0.0, time.time() - updated), 2),
            "load": {"num_running": ld.num_running, "num_waiting": ld.num_waiting,
                     "kv_blocks_in_use": ld.kv_blocks_in_use, "kv_blocks_total": total,
                     "kv_usage": round(ld.kv_blocks_in_use / total, 4) if total else 0.0,
                     "prefill_tokens_per_s": round(ld.prefill_tokens_per_s, 1),
                     "decode_step_s": round(ld.decode_step_s, 5)}}


def assemble(model: str, source: str, workers: list[dict], last, changes: list) -> dict:
    pools = {}
    for w in workers:
        p = pools.setdefault(w["role"], {"replicas": 0, "healthy": 0, "draining": 0})
        draining = w.get("state") == "draining"
        p["replicas"] += not draining
        p["draining"] += draining
        p["healthy"] += bool(w["healthy"])
    return {"model": model, "source": source,
            "pools": {k: pools[k] for k in POOL_ORDER if k in pools},
            "workers": sorted(workers, key=lambda w: (POOL_ORDER.index(w["role"]) if w["role"] in POOL_ORDER else 9,
                                                      w["id"])),
            "planner": {"last": last, "changes": changes} if (last or changes) else None}


async def _planner_records(r, model: str, key: bytes | None) -> tuple[dict | None, list]:
    last = decision.verify(model, await r.get(decision.last_key(model)), key)
    changes = [c for c in (decision.verify(model, raw, key)
                           for raw in await r.lrange(decision.changes_key(model), 0, 9)) if c]
    return last, changes


async def from_redis(url: str, model: str | None, key: bytes | None, auth) -> dict:
    from pdserve.services.redis_conn import connect
    from pdserve.services.registry import Registry
    if model is None:
        r = connect(url, auth)
        try:
            names = sorted({k.decode().split(":")[1] async for k in r.scan_iter("pdserve:*:worker_ids")})
        finally:
            await r.aclose()
        if len(names) != 1:
            raise SystemExit(f"pdserve status: {len(names)} models in this Redis ({', '.join(names) or 'none'}); "
                             "name one with --model")
        model = names[0]
    reg = Registry(url, model, auth=auth, key=key, ttl_s=3600)  # TTL: the key's own expiry says who is live
    try:
        recs = await reg.live_workers()
        last, changes = await _planner_records(reg.r, model, key)
    finally:
        await reg.close()
    workers = [_worker(w.worker_id, w.role, w.address, w.load, w.updated) for w in recs]
    return assemble(model, url.split("@")[-1], workers, last, changes)


async def gateway_status(disp, redis, model: str, key: bytes | None) -> dict:
    """The gateway's `/status` body: the router's view of the workers, the planner's record from Redis."""
    ws = await disp.list_workers()
    loads = {ld.worker_id: ld for ld in ws.loads}
    from pdserve.services.pb import common_pb2
    workers = [_worker(w.worker_id, w.role, w.address, loads.get(w.worker_id, common_pb2.LoadReport()), None)
               for w in ws.workers]
    last, changes = None, []
    if redis is not None:
        try:
            last, changes = await _planner_records(redis, model, key)
        except Exception as e:  # noqa: BLE001 - Redis down: the workers (the router's view) are still worth showing
            log.warning("status: planner record unreadable: %r", e)
    return assemble(model, "gateway", workers, last, changes)


def _from_url(url: str, api_key: str | None) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/status")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def gather(a) -> dict | None:
    from pdserve.services.internal_security import InternalSecurity
    from pdserve.services.redis_conn import RedisAuth
    if a.url:
        return _from_url(a.url, a.api_key or os.environ.get("PDSERVE_API_KEY"))
    url, model, token_file = a.redis_url, a.model, a.internal_token_file
    if url is None:
        local = find_local()
        if local is None:
            print(f"pdserve status: no local `pdserve up` is running (none in {state_dir()}); give --url or "
                  "--redis-url", file=sys.stderr)
            return None
        url, model = local["redis_url"], model or local.get("model")
        token_file = token_file or local.get("internal_token_file")
    key = InternalSecurity.from_files(token_file).registry_key()
    auth = RedisAuth.from_files(a.redis_password_file, a.redis_ca_file)
    st = asyncio.run(from_redis(url, model, key, auth))
    if a.redis_url is None:
        st = with_processes(st, local)
    return st


def with_processes(st: dict, local: dict) -> dict:
    """Local `up`: each worker also gets its pid, metrics port and state (serving; starting: not registered yet;
    draining: sent SIGTERM by the planner, no longer in the registry, not exited yet)."""
    draining = set(local.get("draining", ()))
    by_id = {w["id"]: w for w in st["workers"]}
    workers = list(st["workers"])
    for p in local.get("processes", ()):
        if not p.get("role"):
            continue
        state = "draining" if p["pid"] in draining else "serving" if p["worker_id"] in by_id else "starting"
        w = by_id.get(p["worker_id"])
        if w is None:
            w = {"id": p["worker_id"], "role": p["role"], "healthy": False, "address": f"127.0.0.1:{p['port']}",
                 "age_s": None, "load": _worker("", "", "", _empty_load(), None)["load"]}
            workers.append(w)
        w.update(pid=p["pid"], metrics_port=p.get("metrics_port"), state=state)
    return assemble(st["model"], st["source"], workers, (st["planner"] or {}).get("last"),
                    (st["planner"] or {}).get("changes", []))


def _empty_load():
    from pdserve.services.pb import common_pb2
    return common_pb2.LoadReport()


def format_text(st: dict) -> str:
    lines = [f"model {st['model']} ({st['source']})",
             "pools: " + (", ".join(f"{k} {v['healthy']}/{v['replicas']} healthy"
                                    + (f" ({v['draining']} draining)" if v.get("draining") else "")
                                    for k, v in st["pools"].items()) or "no workers")]
    lines.append(f"{'worker':28} {'role':8} {'healthy':8} {'running':>7} {'waiting':>7} {'KV use':>7}")
    for w in st["workers"]:
        ld = w["load"]
        lines.append(f"{w['id'][:28]:28} {w['role']:8} {str(w['healthy']).lower():8} {ld['num_running']:7d} "
                     f"{ld['num_waiting']:7d} {ld['kv_usage']:7.1%}" + (f"  {w['state']}" if "state" in w else ""))
    pl = st.get("planner")
    if pl and pl.get("last"):
        d = pl["last"]
        age = time.time() - d["time"]
        pools = ", ".join(f"{p['pool']} {p['current']}->{p['desired']} ({p['action']}: {p['reason']})"
                          for p in d["pools"])
        lines.append(f"planner ({d['connector']}{', dry run' if d['dry_run'] else ''}), {age:.0f} s ago: {pools}; "
                     f"forecast {d['forecast_rate']:.2f} req/s (observed {d['observed_rate']:.2f})")
    else:
        lines.append("planner: no decision recorded")
    return "\n".join(lines)
